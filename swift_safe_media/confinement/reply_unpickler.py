"""The caller's unpickler for what a sandbox sends back: only what replies are made of.

A sandbox's reply is a pickle, and unpickling runs whatever callables the stream names
(``os.system``, ``builtins.eval``, ...). The sandbox is the process that runs an
exploitable decoder on hostile media, so its bytes are the attacker's: a plain
``pickle.Unpickler`` in the caller would hand an exploited decoder the trainer itself,
past every layer of confinement. :class:`ReplyUnpickler` resolves only the globals in
:data:`ALLOWED` (the rebuilders of :mod:`.pickling`, numpy's, the containers and scalars
of the standard library, our errors and the decoders' metadata), exception classes the
caller has already imported (built without running their ``__init__``), and what a
user adds with ``SWIFT_SAFE_MEDIA_REPLY_GLOBALS``. Anything else refuses the reply:
:class:`RefusedReply`, which the pool turns into a :class:`~.errors.MediaDecodeCrash`
naming the refused global and kills the sandbox (:meth:`RefusedReply.error`).

A refused name is never imported, and a name is looked up in a module's namespace itself
(``vars``), never through a module ``__getattr__`` that could import on the reply's word. A
class written in Python that a reply names could have its attributes set by the stream
(pickle's BUILD applied to the class itself); such a class is checked after the load and
put back, the reply refused, if it changed.
"""

from __future__ import annotations

import pickle
import sys

from .. import config
from ..errors import MediaDecodeCrash

# module -> names a reply may use. Why each is here:
ALLOWED: dict[str, frozenset[str]] = {name: frozenset(names.split()) for name, names in {
    # How CPU tensors, PIL images and strided arrays travel (pickling.Pickler): these
    # rebuild them from out-of-band buffers and check what they are given.
    "swift_safe_media.engine.pickling": "_rebuild_tensor _rebuild_image _rebuild_strided_array",
    # numpy's own pickling of contiguous arrays (protocol 5), of dtypes and of scalars:
    # these refuse object dtypes over raw memory (see _INSTEAD for ndarray itself).
    "numpy": "dtype",
    "numpy._core.numeric": "_frombuffer",
    "numpy._core.multiarray": "scalar",
    "numpy.core.numeric": "_frombuffer",  # numpy 1.x's names of the same
    "numpy.core.multiarray": "scalar",
    # Shapes and devices; torch's dtypes (torch.float32, pickled by name) are allowed by
    # _torch_dtype. Tensors come through _rebuild_tensor: torch's own storage pickles
    # rebuild through torch.load, and are refused.
    "torch": "Size device",
    # Containers and scalars that pickle by reference to their type. Not range or
    # bytearray (protocol 5 carries bytearrays itself): called with a number, they and
    # list() would let a reply fill the trainer's memory.
    # (Classes written in Python, such as Fraction or Path, are not here: a user names them.)
    "builtins": "set frozenset complex slice list dict tuple",
    "collections": "OrderedDict defaultdict deque",
    # Errors a decode raises, with their fields (path, reason, elapsed, fault verdict).
    "swift_safe_media.errors": "MediaDecodeError MediaDecodeTimeout MediaDecodeCrash MediaQuarantined "
                               "MediaMachineFault",
    # A media path a result mentions comes back as the path (never as a descriptor).
    "swift_safe_media.confinement.handed": "HandedPath",
    # What the twins return besides frames and samples.
    "swift_safe_media.decoders.videoinfo": "VideoInfo Seconds",
    # What stock entry points run whole in the sandbox return besides arrays
    # (patching/media_libraries.py): transformers' load_video gives its metadata.
    "transformers.video_utils": "VideoMetadata",
}.items()}


class _NdarrayType:
    """What a reply gets for ``numpy.ndarray``: called itself, ndarray views raw memory as
    any dtype it is given, object pointers of the sender's choosing included; numpy's
    pickles name it only as the type :func:`_reconstruct` makes (an empty array that
    ``__setstate__`` then fills, which checks the data)."""


def _reconstruct(subtype, shape, dtype):
    import numpy as np

    if subtype is not _NdarrayType:
        raise TypeError(f"numpy's _reconstruct of {subtype!r} is not allowed in a reply")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


# (module, name) -> what a reply gets in its place.
_INSTEAD = {("numpy", "ndarray"): _NdarrayType,
            **{(module, "_reconstruct"): _reconstruct
               for module in ("numpy._core.multiarray", "numpy.core.multiarray")}}


class RefusedReply(pickle.UnpicklingError):
    """A sandbox's reply that the caller would not unpickle: a global outside the
    allow-list (``refused`` names it), or a stream that fails to rebuild."""

    refused: str | None = None

    def error(self, path, pid: int, elapsed: float) -> MediaDecodeCrash:
        """The typed error for the caller: the sandbox's crash, not a result."""
        return MediaDecodeCrash(path, f"sandbox pid {pid} sent a reply the caller refused to unpickle ({self}); "
                                      f"the sandbox was killed", elapsed)


class ReplyUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        found = self._resolve(module, name)
        if isinstance(found, type) and not found.__flags__ & _IMMUTABLE_TYPE:
            self._classes.setdefault(found, dict(vars(found)))  # checked after the load
        return found

    def _resolve(self, module, name):
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if (module, name) in _INSTEAD:
            return _INSTEAD[module, name]
        if module in _widened():
            return _user_global(module, name)
        found = _torch_dtype(module, name) or _foreign_exception(module, name)
        if found is not None:
            return found
        raise _refused(module, name, f"is not allowed in a reply; if your function returns it, "
                                     f"add {module}:{name} to {config.REPLY_GLOBALS}")

    def load(self):
        self._classes: dict[type, dict] = {}
        try:
            loaded = super().load()
        except RefusedReply:
            raise
        except Exception as exc:  # allowed callables given what they do not take, a truncated stream
            raise RefusedReply(f"the reply does not rebuild: {type(exc).__name__}: {exc}") from exc
        finally:
            changed = [cls for cls, before in self._classes.items() if _put_back(cls, before)]
        if changed:
            raise RefusedReply(f"the reply changed the class {changed[0].__module__}.{changed[0].__qualname__} "
                               f"(put back)")
        return loaded


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: built-in and C types, whose attributes cannot be set


def _put_back(cls: type, before: dict) -> bool:
    """Restore ``cls``'s attributes to ``before``; whether any had changed."""
    now = vars(cls)
    if len(now) == len(before) and all(now.get(name, before) is value for name, value in before.items()):
        return False
    for name in [name for name in now if name not in before]:
        delattr(cls, name)
    for name, value in before.items():
        if now.get(name, before) is not value:
            setattr(cls, name, value)
    return True


_widened_cache: list = [None, {}]


def _widened() -> dict[str, frozenset[str]]:
    """``SWIFT_SAFE_MEDIA_REPLY_GLOBALS`` as module -> names ("*": every class and function
    the module defines itself), parsed again only when the setting changes."""
    entries = tuple(config.get(config.REPLY_GLOBALS))
    if _widened_cache[0] != entries:
        table: dict[str, set[str]] = {}
        for entry in entries:
            module, _, name = entry.partition(":")
            table.setdefault(module.strip(), set()).add(name.strip() or "*")
        _widened_cache[:] = [entries, {module: frozenset(names) for module, names in table.items()}]
    return _widened_cache[1]


def _user_global(module: str, name: str):
    """A global the user allowed. Only a name the module itself defines: a dotted name or
    one the module imported from elsewhere (``mymodule.os``) would reach past it."""
    names = _widened()[module]
    if "." not in name and (name in names or "*" in names):
        __import__(module)  # the user named this module: importing it is theirs to allow
        obj = vars(sys.modules[module]).get(name)
        if getattr(obj, "__module__", None) == module and getattr(obj, "__qualname__", None) == name:
            return obj
    raise _refused(module, name, f"is not one {config.REPLY_GLOBALS} allows (a class or function "
                                 f"{module} defines, named there)")


def _refused(module: str, name: str, why: str) -> RefusedReply:
    error = RefusedReply(f"global {module}.{name} {why}")
    error.refused = f"{module}.{name}"
    return error


def _torch_dtype(module: str, name: str):
    """One of torch's dtypes, which pickle by name (``torch.float32``)."""
    torch = sys.modules.get("torch") if module == "torch" and "." not in name else None
    if torch is None:
        return None
    dtype = vars(torch).get(name)
    return dtype if isinstance(dtype, torch.dtype) else None


def _foreign_exception(module: str, name: str):
    """An exception class of a module the caller has already imported (``call`` returns what
    ``fn`` raised as itself: av's, PIL's, a user's own), as a builder that runs none of its
    code: the instance is made by its nearest built-in base and gets its args and fields,
    never a call of the class's own ``__init__``."""
    loaded = sys.modules.get(module)
    cls = vars(loaded).get(name) if loaded is not None and "." not in name else None
    if not (isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == module):
        return None
    return _ExceptionBuilder(cls)


class _ExceptionBuilder:
    def __init__(self, cls):
        self.cls = cls
        self.base = next(base for base in cls.__mro__ if base.__module__ == "builtins")

    def __call__(self, *args):
        if self.cls is self.base:  # a built-in exception's own code is the interpreter's
            return self.cls(*args)
        return self.base.__new__(self.cls, *args)
