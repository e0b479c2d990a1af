"""Imported first by the warm forkserver (see :mod:`.forkserver`): its imports, once."""

from .forkserver import preload_in_forkserver

preload_in_forkserver()
