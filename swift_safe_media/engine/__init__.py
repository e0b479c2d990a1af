"""The sandbox engine: a function called in a confined sandbox process, forked from a
clean zygote, with a hard timeout.

Owns: the calling API (:mod:`.calls`: ``call``, ``call_each``, ``isolated``), the pool
of a process's sandboxes and one exchange with a sandbox (:mod:`.pool`), the kinds of
sandbox and what each holds before its call (:mod:`.sandbox_kinds`), both ends of
the zygote protocol (:mod:`.zygote`), how a zygote starts (:mod:`.zygote_start`), the
zygote a rank shares with its workers (:mod:`.shared_zygote`), the sandbox's own side
(:mod:`.sandbox`), messages and shared memory (:mod:`.transport`, :mod:`.pickling`), the
run's temporary folders (:mod:`.run_folders`), whose fault a failure is (:mod:`.faults`)
and a call's deadline that does not count the time it was kept from a CPU
(:mod:`.fair_clock`). May import: the package's foundations (``config``, ``errors``,
``process``, ``logs``), :mod:`..confinement`, :mod:`..records` and
:mod:`..workers`' checks the sandbox needs; never :mod:`..hosts`, :mod:`..checks` or
the activation layer.

``swift_safe_media.engine`` was one module before it was this package; its public
names (``call``, ``call_each``, ``isolated``, ``shutdown``, ...) are still found here.
"""


import importlib
import os


def __getattr__(name):
    # Lazily: importing one engine module need not load the calling API. A submodule's
    # name is left to the import system (``from .engine import pool`` imports it).
    if not name.startswith("__") and not os.path.exists(os.path.join(os.path.dirname(__file__), f"{name}.py")):
        calls = importlib.import_module(f"{__name__}.calls")
        if hasattr(calls, name):
            return getattr(calls, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
