"""How a DataLoader's workers start: one decision, made once as the loader starts its
workers, from inputs gathered in one place (:class:`StartInputs`), and written once.

The rules, in order (docs/how-it-works.md#how-workers-start; one test per row in
tests/test_start_method.py). Rows 1-5 choose the method; rows 6 and 7 then check it:

1. a host's adapter prefers a method for this loader -> the host's method;
2. the user named one (the loader's ``multiprocessing_context``, or
   ``multiprocessing.set_start_method`` other than the platform's default) -> kept;
3. ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` is ``default`` or ``fork`` -> the platform's default, kept;
4. the dataset, ``collate_fn`` or ``worker_init_fn`` cannot be pickled -> ``fork`` (warning);
5. otherwise -> ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (the warm forkserver by default);
6. the method is spawn or forkserver and the main script's running statement is outside
   ``if __name__ == "__main__":`` (its children would run it again), or a child could not
   import what it needs of the main module (``python -``; the dataset defined under
   ``python -c``, the REPL or a notebook, or by a script only under its main guard or by
   exec) -> ``fork`` (warning);
7. the method is the warm forkserver and it has threads -> ``spawn`` (warning).

Each input is read only when a rule needs it (pickling the dataset, reading the script,
waiting for the forkserver's report cost time), so a loader pays for no check it does
not reach; where a holding server has the dataset as it pickles now, its bytes stand for
the check's own pickle (:meth:`StartInputs._held_pickling`).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
from dataclasses import dataclass

from .. import config
from ..patching import host_adapters
from . import spawn_guard

log = logging.getLogger("swift_safe_media")

FORKSERVER = "forkserver"

_warned: set[str] = set()  # what a warning named already: dataset types, scripts, the forkserver


@dataclass(frozen=True)
class Decision:
    method: str  # how the workers start
    rule: int  # the row of the table that decided
    warning: tuple[str, str] | None = None  # (what it names, the message), logged once per name

    @property
    def writes(self) -> bool:
        """Whether the loader's ``multiprocessing_context`` changes (rows 2 and 3 keep it)."""
        return self.rule not in (2, 3)


class StartInputs:
    """What the decision reads about ``loader``, each read once and only when asked."""

    def __init__(self, loader):
        self.loader = loader

    @functools.cached_property
    def current(self) -> str:
        """The method the workers would start by now."""
        return spawn_guard.start_method(self.loader)

    @functools.cached_property
    def host_prefers(self) -> str | None:
        return host_adapters.hosts_worker_start_method(self.loader)

    @functools.cached_property
    def named(self) -> bool:
        if self.loader.multiprocessing_context is not None:
            return True
        method = multiprocessing.get_start_method(allow_none=True)
        # Set globally to the platform's own default (fork on Linux): cannot be told from no choice.
        return method is not None and method != multiprocessing.get_all_start_methods()[0]

    @functools.cached_property
    def configured(self) -> str:
        return config.mp_context()

    @functools.cached_property
    def held(self):
        """The holding server that has the dataset and ``collate_fn`` as they pickle now, or None
        (:func:`.hold_ahead.serving_for`; one that has them as they were is ended)."""
        from . import hold_ahead

        return hold_ahead.serving_for(self.loader)

    @functools.cached_property
    def _pickling(self) -> tuple[bytes | Exception, frozenset[str]]:
        loader = self.loader
        try:
            return self._held_pickling() or spawn_guard.pickle_noting_main(
                (loader.dataset, loader.collate_fn, loader.worker_init_fn))
        except Exception as exc:
            return exc, frozenset()

    def _held_pickling(self) -> tuple[bytes, frozenset[str]] | None:
        """Where a holding server has the dataset and ``collate_fn`` as they pickle now (the bytes
        the workers' launch writes, which is the proof that they pickle) and those name nothing of
        ``__main__`` (:func:`.spawn_guard.may_name_main`): its bytes, not a second pickle of them.
        The ``worker_init_fn`` (where a server holds: none, a function, or a partial of one over
        plain values) is pickled alone."""
        server = self.held
        if server is None or spawn_guard.may_name_main(server.data):
            return None
        _, names = spawn_guard.pickle_noting_main(self.loader.worker_init_fn)
        return None if names else (server.data, frozenset())

    @property
    def pickled(self) -> bytes | Exception:
        """The dataset, collate_fn and worker_init_fn as pickle writes them, or why it cannot."""
        return self._pickling[0]

    @property
    def main_names(self) -> frozenset[str]:
        """The classes and functions of ``__main__`` they refer to, by qualified name."""
        return self._pickling[1]

    @functools.cached_property
    def unpicklable(self) -> str | None:
        """Why the dataset, collate_fn or worker_init_fn cannot be pickled, or None."""
        failed = self.pickled
        return f"{type(failed).__name__}: {failed}" if isinstance(failed, Exception) else None

    @functools.cached_property
    def dataset_type(self) -> str:
        return type(self.loader.dataset).__qualname__

    @functools.cached_property
    def main_would_rerun(self) -> tuple[str, int] | None:
        """(script, line) a child would run again; None when guarded or in a child process."""
        if multiprocessing.parent_process() is not None:
            return None
        return spawn_guard.unguarded_main_statement()

    @functools.cached_property
    def main_unreachable(self) -> str | None:
        """Why a spawned or forkserver child could not import what it needs of the main
        module; None when it can, or in a child process."""
        if multiprocessing.parent_process() is not None:
            return None
        return spawn_guard.main_unreachable(lambda: self.pickled if isinstance(self.pickled, bytes) else None,
                                            lambda: self.main_names)

    @functools.cached_property
    def forkserver_problem(self) -> str | None:
        from . import forkserver

        return forkserver.forkserver_verdict(config.start_timeout())


def decide(inputs) -> Decision:
    """The table above, row by row."""
    chosen = _choose(inputs)
    method = chosen.method
    if method in spawn_guard.RERUN_BY_CHILDREN and inputs.main_would_rerun is not None:
        script, line = inputs.main_would_rerun
        return Decision("fork", 6, (script, (
            f"swift_safe_media: {script} starts DataLoader workers at line {line} outside "
            f"`if __name__ == \"__main__\":`; {method} workers would run the script again and the run would "
            f"hang, so this DataLoader forks its workers instead. Put the training code under that guard to "
            f"get {method} workers.")))
    if method in spawn_guard.RERUN_BY_CHILDREN and inputs.main_unreachable is not None:
        return Decision("fork", 6, ("__main__", (
            f"swift_safe_media: {inputs.main_unreachable}, so this DataLoader forks its workers, as stock "
            f"PyTorch's do, instead of starting them by {method} (decodes are still bounded)")))
    if method == FORKSERVER and inputs.forkserver_problem is not None:
        return Decision("spawn", 7, (FORKSERVER, f"swift_safe_media: {inputs.forkserver_problem}; "
                                                 f"DataLoader workers are spawned instead"))
    return chosen


def _choose(inputs) -> Decision:
    if inputs.host_prefers:
        return Decision(inputs.host_prefers, 1)
    if inputs.named:
        return Decision(inputs.current, 2)
    if inputs.configured in ("default", "fork"):
        return Decision(inputs.current, 3)
    if inputs.unpicklable is not None:
        name = inputs.dataset_type
        return Decision("fork", 4, (name, (
            f"swift_safe_media: the DataLoader's dataset ({name}) cannot be pickled ({inputs.unpicklable}), so "
            f"its workers fork from this process, as stock PyTorch's do, instead of starting from the "
            f"{inputs.configured} (decodes are still bounded)")))
    return Decision(inputs.configured, 5)


def context_for(method: str):
    """What a DataLoader's ``multiprocessing_context`` is set to for ``method``: for the warm
    forkserver, ``WarmForkServerContext`` (its workers unpickle side by side, each asking for
    its first sandbox as it begins: :mod:`.forkserver_launch`); else the method's name."""
    if method == FORKSERVER:
        from .forkserver_launch import warm_context

        return warm_context()
    return method


def apply(loader, decision: Decision) -> None:
    """Write the decision to ``loader`` (once) and log its warning (once per name)."""
    if decision.writes:
        loader.multiprocessing_context = context_for(decision.method)
    if decision.warning is not None:
        name, message = decision.warning
        if name not in _warned:
            _warned.add(name)
            log.warning(message)
