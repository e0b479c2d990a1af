"""LLaMA-Factory's preprocessing ``map`` processes, started from the warm forkserver.

``preprocessing_num_workers: N`` makes ``Dataset.map`` start ``N`` processes with datasets'
``Pool`` (``multiprocess.Pool``, dill's copy of multiprocessing), which forks the trainer,
the locks its threads held and the state its decoders left included. Under protection,
the pool of a map whose function is LLaMA-Factory's (its dataset processor's
``preprocess_dataset``) is a pool of CPython's ``forkserver`` context instead: its
processes fork from the warm forkserver, as the DataLoader workers do, at fork's cost.
datasets sends every task pickled either way (with dill to its own pool, with pickle to
this one), so nothing more travels; the processes adopt the trainer's environment as it
was when the pool was asked for (datasets sets ``TOKENIZERS_PARALLELISM`` for its
processes then). Rows are dropped, named and counted in them as in forked ones.

The targets are multiprocess's ``Pool`` (datasets 4.0-4.7 call the copy
``from multiprocess import Pool`` put in ``arrow_dataset``, which is patched with it; 4.8 on
call ``mp.Pool``) and, up to datasets 4.7, py_utils' ``Manager``. ``Pool`` (:func:`map_pool`)
is called with the number of processes only, so the map function is read from its caller,
``Dataset.map`` (its ``function`` and ``fn_kwargs``). While such a pool is open, the
manager datasets starts for its progress queue starts from the warm forkserver too
(:func:`map_manager` up to 4.7; from 4.8 datasets asks the pool's own context for it):
nothing of the map forks the trainer. The stock pool is made, as before, where
- the map is not LLaMA-Factory's (another host's map, datasets' own uses of ``Pool``), or
  ``Dataset.map`` is not the caller (another datasets version): nothing said;
- a start method was named (``multiprocess.set_start_method``, or
  ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` other than ``forkserver``): the user's wins;
- the warm forkserver is not ours or has threads, or its processes would run the main
  script again, or the function does not pickle: one log line says why.
"""

from __future__ import annotations

import contextvars
import logging
import multiprocessing
import multiprocessing.pool
import sys

from ... import config, process
from ...patching.targets import original_of
from ...workers import forkserver as warm_start, spawn_guard
from .workers import _announce

log = logging.getLogger("swift_safe_media")

POOL_MODULE = "multiprocess"  # datasets' Pool: `from multiprocess import Pool` (4.0-4.7), `mp.Pool` (4.8 on)
DATASETS_MANAGER_MODULE = "datasets.utils.py_utils"  # iflatmap_unordered's Manager

_warm_pool_open = contextvars.ContextVar("swift_safe_media_warm_map_pool", default=False)


class WarmMapPool(multiprocessing.pool.Pool):
    """A map's pool of processes forked from the warm forkserver; while it is open
    (``with``, as datasets uses it), datasets' manager starts there too."""

    def __enter__(self):
        self._open = _warm_pool_open.set(True)
        return super().__enter__()

    def __exit__(self, *exc_info):
        _warm_pool_open.reset(self._open)
        return super().__exit__(*exc_info)


def map_pool(*args, **kwargs):
    """datasets' ``Pool(processes)``: the warm forkserver's pool for LLaMA-Factory's map."""
    stock = original_of(sys.modules[POOL_MODULE].Pool)
    try:
        mapped = _map_function(_caller()) if len(args) == 1 and not kwargs else None
        why_not = _why_not_forkserver(mapped) if mapped is not None else _QUIET
    except Exception as exc:  # fail open: the stock pool
        why_not = f"could not check it ({exc!r})"
    if why_not is None:
        _announce("LLaMA-Factory's preprocessing map processes use the 'forkserver' start method")
        return WarmMapPool(args[0], warm_start.adopt_environment, warm_start.environment_changes(),
                           context=multiprocessing.get_context(warm_start.FORKSERVER))
    if why_not is not _QUIET:
        _announce(f"LLaMA-Factory's preprocessing map processes fork from the trainer, as stock's do: {why_not}")
    return stock(*args, **kwargs)


def map_manager(*args, **kwargs):
    """datasets' ``Manager()``: from the warm forkserver while a :class:`WarmMapPool` is open."""
    if _warm_pool_open.get():
        return multiprocessing.get_context(warm_start.FORKSERVER).Manager(*args, **kwargs)
    return original_of(sys.modules[DATASETS_MANAGER_MODULE].Manager)(*args, **kwargs)


_QUIET = "the stock pool, nothing to say"  # not LLaMA-Factory's map, or a start method was named


def _caller():
    """The frame that asked for the pool: the first outside this package (the patcher's
    forwarder calls the stand-in)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("swift_safe_media."):
        frame = frame.f_back
    return frame


def _map_function(frame):
    """The function (with its keyword arguments) that ``Dataset.map`` in ``frame`` maps, if
    it is LLaMA-Factory's; else None."""
    if frame is None or frame.f_code.co_name != "map":
        return None
    if not frame.f_globals.get("__name__", "").startswith("datasets."):
        return None
    scope = frame.f_locals
    function = scope.get("function")
    owner = getattr(function, "func", function)  # a functools.partial
    owner = getattr(owner, "__self__", owner)  # a bound method: its processor
    module = getattr(owner, "__module__", None) or type(owner).__module__
    if not str(module).startswith("llamafactory."):
        return None
    return function, scope.get("fn_kwargs")


def _start_method_named() -> bool:
    """Whether multiprocess's start method was set to another than its default. Not
    ``get_start_method(allow_none=True)``: any earlier use of its default context (another
    map's pool) sets that too. Naming the default itself cannot be told from such a use."""
    from multiprocess import context

    default = context._default_context
    actual = getattr(default, "_actual_context", None)
    return actual is not None and actual is not default._default_context


def _why_not_forkserver(mapped) -> str | None:
    """Why these map processes must not start from the warm forkserver, or None."""
    if config.mp_context() != warm_start.FORKSERVER or _start_method_named():
        return _QUIET
    if process.current().forkserver_environment is None:
        return "the warm forkserver is not running (or not ours)"
    problem = warm_start.forkserver_verdict(config.start_timeout())
    if problem is not None:
        return problem
    if spawn_guard.unguarded_main_statement() is not None:
        return "its processes would run the main script again"
    from multiprocessing.reduction import ForkingPickler

    try:
        ForkingPickler.dumps(mapped)
    except Exception as exc:
        return f"its function does not pickle ({type(exc).__name__}: {exc})"
    return None
