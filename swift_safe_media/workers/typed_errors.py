"""A ``MediaDecodeError`` raised in a DataLoader worker reaches the training loop as itself.

torch sends a worker's exception to the trainer as an ``ExceptionWrapper`` (its type and
its traceback as text) and rebuilds it there with one argument, the text; a
``MediaDecodeError`` takes a path and a reason, so the training loop got a plain
``RuntimeError`` carrying the text. With protection on, the wrapper also carries the
error's type, path, reason and elapsed time, and the trainer raises that error (a
``RuntimeError`` still, so an ``except RuntimeError`` catches it as before), the worker's
traceback added as a note. Two rows of :mod:`..patching.torch_dataloader` (``typed errors``),
patched in the trainer and in each worker.
"""

from __future__ import annotations

import sys

from ..errors import MediaDecodeError

CARRIED = "_swift_safe_media_error"  # (type, path, reason, elapsed): pickled with the wrapper


def wrapper_keeping_media_errors(original, wrapper, exc_info=None, where="in background"):
    """``ExceptionWrapper.__init__``, in a worker: torch's, plus the error's fields."""
    original(wrapper, exc_info, where)
    error = (exc_info or sys.exc_info())[1]
    if isinstance(error, MediaDecodeError):
        setattr(wrapper, CARRIED, (type(error), error.path, error.reason, error.elapsed))


def reraise_media_errors(original, wrapper):
    """``ExceptionWrapper.reraise``, in the trainer: the error itself where it was carried."""
    carried = vars(wrapper).get(CARRIED)
    if carried is None:
        return original(wrapper)
    kind, path, reason, elapsed = carried
    error = kind(path, reason, elapsed)
    error.add_note(f"Caught {kind.__name__} {wrapper.where}.\nOriginal {wrapper.exc_msg}")
    raise error
