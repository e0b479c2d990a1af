"""The package was flat before it was split into subpackages by concern: every old module
path (``swift_safe_media.pool``, ``swift_safe_media.integrations.swift``, ...) still
imports, as the very module that holds that code now, so user code, patches aimed at the
old names and the texts of ``patches/`` and ``upstream_pr/`` keep working."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest

from swift_safe_media import _moved


# Importing it runs the warm forkserver's preparation (gc.freeze, its thread count put in the
# environment for the zygotes it forks): only in a forkserver, never in the test process,
# where it leaked into every later child of the process's other tests.
RUNS_ON_IMPORT = {"_forkserver_preload"}


@pytest.mark.parametrize("old", sorted(set(_moved.MOVED) - RUNS_ON_IMPORT))
def test_an_old_path_is_the_new_module(old):
    new = importlib.import_module(f"swift_safe_media.{_moved.MOVED[old]}")
    assert importlib.import_module(f"swift_safe_media.{old}") is new
    assert new.__spec__.name == new.__name__ == f"swift_safe_media.{_moved.MOVED[old]}"


@pytest.mark.parametrize("old", sorted(RUNS_ON_IMPORT))
def test_an_old_path_of_a_module_that_runs_on_import_finds_the_new_one(old):
    """Found by the old paths' finder, not run; the new one is there to import."""
    spec = importlib.util.find_spec(f"swift_safe_media.{old}")
    assert spec is not None and isinstance(spec.loader, _moved._MovedModuleFinder)
    assert importlib.util.find_spec(f"swift_safe_media.{_moved.MOVED[old]}").origin.endswith(
        _moved.MOVED[old].replace(".", "/") + ".py")


def test_the_old_names_of_public_things_still_import(monkeypatch):
    from swift_safe_media.budget import ErrorBudgetExceeded
    from swift_safe_media.engine import call, call_each, isolated, shutdown
    from swift_safe_media.integrations.swift import FLAGS
    from swift_safe_media.quarantine import entries
    from swift_safe_media.records import budget, quarantine

    assert ErrorBudgetExceeded is budget.ErrorBudgetExceeded and entries is quarantine.entries
    assert call.__module__ == "swift_safe_media.engine.calls" and callable(call_each) and callable(isolated)
    assert callable(shutdown) and FLAGS
    # A patch aimed at the old name reaches the code that runs.
    monkeypatch.setattr("swift_safe_media.quarantine.entries", lambda *args: ["patched"])
    assert quarantine.entries("anything") == ["patched"]


def test_old_paths_work_in_a_fresh_interpreter():
    code = ("import swift_safe_media.pool as pool, swift_safe_media.integrations.lerobot_layouts as layouts; "
            "import swift_safe_media.worker_start as start; "
            "print(pool.__name__, layouts.__name__, start.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["swift_safe_media.engine.pool", "swift_safe_media.hosts.lerobot.layouts",
                                  "swift_safe_media.workers.start"]


def test_an_unknown_name_is_still_missing():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("swift_safe_media.no_such_module")
    with pytest.raises(AttributeError):
        importlib.import_module("swift_safe_media.engine").no_such_name


def test_paths_computed_from_the_package_name_the_folder_that_holds_it():
    """Modules one folder deeper than before still name the package's parent: the zygote
    started by exec imports the caller's package from there, and confined sandboxes may read it."""
    import os

    from swift_safe_media.confinement import reads
    from swift_safe_media.engine import zygote_start

    root = os.path.dirname(os.path.dirname(os.path.abspath(importlib.import_module("swift_safe_media").__file__)))
    assert zygote_start.zygote_environment()["PYTHONPATH"].split(os.pathsep)[0] == root
    ours = [path for path, why, _ in reads.roots() if why.startswith("this package")]
    assert root in ours or any(root.startswith(path + os.sep) for path in ours), ours
