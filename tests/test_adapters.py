"""Every adapter, every import order (dd-trace's PatchTestCase): each case in a fresh
interpreter against the real host; every target of the adapter's table is checked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from swift_safe_media.patching import host_adapters as integrations

from . import megatron_shim
from .fresh import clean_environment, run_python

HOSTS_INSTALLED = {"swift": "swift.template", "lerobot": "lerobot.datasets"}
# Hosts with an environment of their own (their pins): the case runs with its interpreter.
HOST_PYTHON = {"llamafactory": Path(__file__).resolve().parent.parent / ".venv-llamafactory" / "bin" / "python"}


def installed(host: str) -> bool:
    if host in HOST_PYTHON:
        return HOST_PYTHON[host].exists()
    try:
        return importlib.util.find_spec(HOSTS_INSTALLED[host]) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.timeout(200)
@pytest.mark.parametrize("order", ["enable_first", "import_first"])
@pytest.mark.parametrize("host", integrations.known_hosts())
def test_patch_and_restore_in_every_order(host, order, tmp_path):
    if not installed(host):
        pytest.skip(f"{host} is not installed")
    # ms-swift's table includes Megatron-SWIFT's trainer, which imports only with Transformer
    # Engine's name importable (tests/megatron_shim.py).
    env = clean_environment(pythonpath=[megatron_shim.write(str(tmp_path / "te_shim"))]) if host == "swift" else None
    done = run_python(module="tests.programs.adapter_order", args=[host, order], timeout=180, env=env,
                      python=HOST_PYTHON.get(host))
    enabled, twice, disabled, again = json.loads(done.stdout.strip().splitlines()[-1])
    assert enabled["targets"] and all(enabled["targets"].values()), enabled
    assert not enabled["missing"], f"targets the installed {host} lacks: {enabled['missing']}"
    assert enabled["is_patched"] and enabled["is_enabled"]
    assert twice == {**enabled, "step": "enabled twice"}, "enabling twice changes nothing"
    assert not any(disabled["targets"].values()), disabled
    assert not disabled["is_patched"] and not disabled["is_enabled"]
    assert again == {**enabled, "step": "enabled again"}


def test_every_host_folder_registers_an_adapter_that_follows_the_protocol():
    assert integrations.known_hosts() == ["lerobot", "llamafactory", "swift"]
    for host in integrations.known_hosts():
        adapter = integrations.adapter_for(host)  # registered as its module is imported
        assert isinstance(adapter, integrations.HostAdapter) and adapter.HOST == host
        assert adapter.__name__ == f"swift_safe_media.hosts.{host}.adapter"
        integrations.check_adapter(importlib.import_module(adapter.__name__))


def test_an_adapter_gets_a_no_op_default_for_each_optional_hook():
    import types

    minimal = types.ModuleType("minimal_adapter")
    minimal.HOST, minimal.DISTRIBUTION, minimal.SUPPORTED = "minimal", "minimal", ((1, 0), (2, 0))
    minimal.TRIGGER_MODULES = ("minimal",)
    minimal.get_version = minimal.patch = minimal.unpatch = minimal.is_patched = lambda: None
    adapter = integrations.ModuleAdapter(minimal)
    assert adapter.FLAG_MODULES == adapter.WORKER_PRELOAD == ()
    assert adapter.register_flags() is None and adapter.worker_start_method(object()) is None
    assert adapter.command_line_asks_for_protection() is False and adapter.unsupported() is None
    assert adapter.is_launcher() is False
    assert set(integrations.OPTIONAL) <= set(dir(integrations.HostAdapter))


def test_an_adapter_that_breaks_the_protocol_is_refused():
    import types

    broken = types.ModuleType("broken_adapter")
    broken.HOST, broken.DISTRIBUTION, broken.SUPPORTED = "broken", "broken", ((2, 0), (1, 0))
    broken.patch = "not callable"
    with pytest.raises(TypeError) as refused:
        integrations.register(integrations.ModuleAdapter(broken))
    message = str(refused.value)
    for part in ("broken_adapter", "TRIGGER_MODULES", "get_version", "unpatch", "is_patched", "patch",
                 "SUPPORTED as (lowest, first_unsupported)"):
        assert part in message, message


def test_the_start_up_hook_watches_every_host_folder():
    import ast

    hook = Path(__file__).resolve().parent.parent / "_swift_safe_media_startup.py"
    assignment = next(node for node in ast.parse(hook.read_text()).body
                      if isinstance(node, ast.Assign) and node.targets[0].id == "_HOSTS")
    assert sorted(ast.literal_eval(assignment.value)) == integrations.known_hosts()


def test_the_command_lines_that_ask_for_protection_before_the_host_parses_them(tmp_path):
    """Read as a host begins importing (the warm forkserver is forked there, while the
    trainer has one thread): LeRobot's flags, and LLaMA-Factory's YAML and overrides."""
    from swift_safe_media.hosts import flags

    assert flags.asks_for_protection(["--policy.type=act", "--safe_media=true"])
    assert flags.asks_for_protection(["--safe_media", "true", "--steps=2"])
    assert flags.asks_for_protection(["--safe_media"])  # bare: true
    assert not flags.asks_for_protection(["--safe_media=false"])
    assert not flags.asks_for_protection(["--safe_media=maybe"])  # the host's parser reports it
    assert not flags.asks_for_protection(["--steps=2"])
    on, off, nested = tmp_path / "on.yaml", tmp_path / "off.yaml", tmp_path / "nested.yaml"
    on.write_text("model_name_or_path: x\nsafe_media: true  # protected\n")
    off.write_text("safe_media: false\n")
    nested.write_text("extra:\n  safe_media: true\n")
    assert flags.config_file_asks_for_protection([str(on)])
    assert not flags.config_file_asks_for_protection([str(off)])
    assert not flags.config_file_asks_for_protection([str(nested)])  # only a top-level key
    assert flags.config_file_asks_for_protection([str(off), "safe_media=true"])  # the override wins
    assert not flags.config_file_asks_for_protection([str(on), "safe_media=false"])
    assert flags.config_file_asks_for_protection(["--safe_media", "true"])
    assert not flags.config_file_asks_for_protection([str(tmp_path / "missing.yaml")])
