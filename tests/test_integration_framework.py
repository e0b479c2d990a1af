"""The adapter machinery on a small host package written at test time: each import /
enable / disable order runs in a fresh interpreter, as dd-trace's PatchTestCase does.
(The ms-swift and LeRobot adapters are tested against the real hosts elsewhere.)"""

import subprocess
import sys
import textwrap

import pytest

from .fresh import ROOT, clean_environment, run_python


HOST_FILES = {
    "fakehost/__init__.py": "__version__ = '{version}'\n",
    "fakehost/media.py": "def load(path):\n    return 'stock ' + path\n",
    "fakehost/user.py": "from .media import load\nfrom .media import load as renamed_load\n",
    "fake_adapter.py": textwrap.dedent("""
        import sys
        from swift_safe_media.patching.host_adapters import ModuleAdapter, register
        from swift_safe_media.patching.targets import Patcher

        HOST = DISTRIBUTION = "fakehost"
        SUPPORTED = ((1, 0), (2, 0))
        TRIGGER_MODULES = ("fakehost.media",)
        _patcher = Patcher(("fakehost",))

        def get_version():
            return sys.modules["fakehost"].__version__ if "fakehost" in sys.modules else None

        def safe_load(path):
            if path == "explode":
                raise RuntimeError("adapter bug")
            return "safe " + path

        def patch():
            _patcher.replace("fakehost.media", "load", safe_load)
            if "{fail}" == "yes":
                raise RuntimeError("cannot patch this host")

        def unpatch():
            _patcher.restore()

        def is_patched():
            return bool(_patcher)

        ADAPTER = register(ModuleAdapter(sys.modules[__name__]))
    """),
}

def run_order(tmp_path, case, *args, version="1.4", fail="no"):
    """Write the host package, then ``tests/programs/fake_host_orders.py`` CASE ARGS."""
    for name, text in HOST_FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace("{version}", version).replace("{fail}", fail))
    env = clean_environment(pythonpath=[str(tmp_path), ROOT])
    done = run_python(module="tests.programs.fake_host_orders", args=[case, *args], env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), done.stderr


SAFE = "('safe a', 'safe a', 'safe a')"
STOCK = "('stock a', 'stock a', 'stock a')"


def test_enable_before_host_import(tmp_path):
    out, _ = run_order(tmp_path, "enable_first")
    assert out == [f"{SAFE} True 1"]


def test_enable_after_host_import(tmp_path):
    out, _ = run_order(tmp_path, "enable_after")
    assert out == [STOCK, SAFE]


def test_enable_disable_enable_and_double_enable(tmp_path):
    out, _ = run_order(tmp_path, "enable_disable_enable")
    assert out == [f"{SAFE} True", f"{STOCK} True 0 False", SAFE,
                   "[('fakehost.media', 'load'), ('fakehost.user', 'load'), ('fakehost.user', 'renamed_load')]"]


def test_settings_reach_the_environment(tmp_path):
    out, _ = run_order(tmp_path, "settings")
    assert out[0] == "7.5 forkserver 1024"
    assert out[1].startswith("refused: SWIFT_SAFE_MEDIA_MP_CONTEXT='threads'")


def test_unsupported_version_warns_once_and_leaves_the_host_alone(tmp_path):
    out, err = run_order(tmp_path, "reload", version="2.1")
    assert out == [STOCK]
    assert err.count("fakehost 2.1 is outside the supported range >=1.0,<2.0") == 1


def test_a_patch_that_fails_is_undone(tmp_path):
    out, err = run_order(tmp_path, "enable", fail="yes")
    assert out == [STOCK]
    assert "could not patch fakehost; it runs unprotected" in err


@pytest.mark.parametrize("value, expected", [("1", SAFE), ("0", STOCK), (None, STOCK)])
def test_startup_hook_follows_the_environment(tmp_path, value, expected):
    """The installed .pth watches the host's first import; SWIFT_SAFE_MEDIA decides."""
    out, _ = run_order(tmp_path, "startup_hook", *([] if value is None else [value]))
    assert out == [expected]


def test_startup_hook_is_installed_and_cheap():
    """`swift_safe_media.pth` runs at start-up: it imports nothing but its own tiny module."""
    code = ("import sys; print(hasattr(sys, '_swift_safe_media_watcher'), "
            "'swift_safe_media' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd="/")
    assert done.stdout.split() == ["True", "False"], "install the package (make test does) for the .pth"


def test_a_hook_added_while_its_module_still_executes_runs_again_once_it_is_done(tmp_path):
    """A host module that imports, half-way through, what turns protection on (LeRobot's
    training script imports its argument parser, where the flags are): the hook runs at
    once on what is defined so far, and again when the module is done; the module keeps
    a plain spec."""
    package = tmp_path / "latehost"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "script.py").write_text("import latehost.parser\n\ndef defined_late():\n    return 'stock'\n")
    (package / "parser.py").write_text(textwrap.dedent("""
        from swift_safe_media.patching.host_adapters import _imports
        seen = []
        _imports.when_imported("latehost.script", lambda module: seen.append(hasattr(module, "defined_late")))
    """))
    code = ("import importlib.machinery, latehost.script, latehost.parser;"
            "print(latehost.parser.seen, type(latehost.script.__spec__) is importlib.machinery.ModuleSpec)")
    done = run_python(code=code, env=clean_environment(pythonpath=[str(tmp_path), ROOT]))
    assert done.stdout.split() == ["[False,", "True]", "True"]
