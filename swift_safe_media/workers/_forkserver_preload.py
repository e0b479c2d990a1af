"""Imported first by the warm forkserver (see :mod:`.warm_start`): its imports, once."""

from .forkserver import preload_in_forkserver

preload_in_forkserver()
