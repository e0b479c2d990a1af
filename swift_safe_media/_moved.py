"""Old module paths, kept working: the package was flat before it was split into
subpackages by concern (see docs/how-it-works.md#layout). ``import swift_safe_media.pool``,
``from swift_safe_media.integrations.swift import FLAGS`` or a patch aimed at
``swift_safe_media.quarantine.entries`` find the module that now holds that code, as
the same module object (one copy of its state).

One table, old name -> new name, served by a meta-path finder installed when the
package is imported. New code imports the new paths; ``swift_safe_media.engine`` is
not here: it is the engine's package now, and serves the old module's names itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "pool": "engine.pool",
    "zygote": "engine.zygote",
    "zygote_start": "engine.zygote_start",
    "shared_zygote": "engine.shared_zygote",
    "sandbox": "engine.sandbox",
    "transport": "engine.transport",
    "pickling": "engine.pickling",
    "run_folders": "engine.run_folders",
    "faults": "engine.faults",
    "confine": "confinement.policy",
    "confine_kernel": "confinement.kernel",
    "confine_reads": "confinement.reads",
    "confine_env": "confinement.environment",
    "confine_output": "confinement.output",
    "handed": "confinement.handed",
    "worker_start": "workers.start",
    "warm_start": "workers.forkserver",
    "_forkserver_preload": "workers._forkserver_preload",
    "plain_workers": "workers.plain",
    "worker_watchdog": "workers.trainer_watchdog",
    "spawn_guard": "workers.spawn_guard",
    "accounting": "records.accounting",
    "quarantine": "records.quarantine",
    "watchdog": "records.watchdog",
    "summary": "records.summary",
    "budget": "records.budget",
    "trainer_callback": "records.trainer_callback",
    "preflight": "checks.preflight",
    "doctor": "checks.doctor",
    "scan": "checks.scan",
    "scan_ray": "checks.scan_ray",
    "integrations": "patching.host_adapters",
    "integrations._patching": "patching.targets",
    "integrations._imports": "patching.import_hooks",
    "integrations.media": "patching.media_libraries",
    "integrations.flags": "hosts.flags",
    "integrations.swift": "hosts.swift.adapter",
    "integrations.swift_templates": "hosts.swift.templates",
    "integrations.swift_coverage": "hosts.swift.coverage",
    "integrations.swift_inference": "hosts.swift.inference",
    "integrations.swift_serving": "hosts.swift.serving",
    "integrations.swift_rollouts": "hosts.swift.rollouts",
    "integrations.lerobot": "hosts.lerobot.adapter",
    "integrations.lerobot_layouts": "hosts.lerobot.layouts",
    "integrations.lerobot_decode": "hosts.lerobot.decode",
    "integrations.lerobot_substitute": "hosts.lerobot.substitute",
    "integrations.lerobot_workers": "hosts.lerobot.workers",
    "integrations.llamafactory": "hosts.llamafactory.adapter",
    "integrations.llamafactory_decode": "hosts.llamafactory.decode",
    "integrations.llamafactory_rows": "hosts.llamafactory.rows",
    "integrations.llamafactory_workers": "hosts.llamafactory.workers",
}

_PREFIX = "swift_safe_media."


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name and loads it as the module that holds its code now."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX):] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(_PREFIX + MOVED[spec.name[len(_PREFIX):]])
        spec.loader_state = module.__spec__  # the import system gives the module the old name's spec...
        old = spec.name[len(_PREFIX):]
        if not hasattr(module, "__path__") and any(name.startswith(old + ".") for name in MOVED):
            # An old package now a module (``integrations``): its old submodules are still
            # found (by this finder), which the import system allows only below a package.
            module.__path__ = []
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # ...and it keeps its own


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
