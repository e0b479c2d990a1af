"""Protection that cannot work says so at once: in an environment where one piece the
decoders need is really missing (see ``broken_envs``), the real ``swift sft``, LeRobot's
flag parser and a plain script calling ``enable()`` stop before anything is decoded,
with one message naming the piece and the command that installs it. ``swift-safe-media
doctor`` shows the same, and everything in force in a healthy environment."""

import ast
import os
import re
import subprocess
import sys
import time

import pytest

from . import broken_envs
from . import swift_scenario as scenario
from .fresh import ROOT

KINDS = broken_envs.KINDS
SCRIPT_BOUND_S = 60     # a refusal is a torch import plus ~0.1 s: seconds; bounds for a busy 2-core box
SWIFT_BOUND_S = 150     # `swift sft` imports ms-swift, transformers and torch before it parses flags


class _Envs(dict):
    """Each broken environment, made when a test first asks for it; a test whose
    environment cannot be made here (no LeRobot venv, say) is skipped, saying why."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, kind):
        try:
            self[kind] = broken_envs.make(kind, str(self.folder / kind))
        except RuntimeError as exc:
            pytest.skip(str(exc))
        return self[kind]


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    return _Envs(tmp_path_factory.mktemp("broken_envs"))


def run(env_of, argv, *, env=None, timeout=300, cwd=None):
    python, prefix = env_of
    start = time.monotonic()
    result = subprocess.run(prefix + [python if argv[0] == "python" else os.path.join(os.path.dirname(python), argv[0]),
                                      *argv[1:]],
                            capture_output=True, text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL,
                            env=broken_envs.scrubbed_environment(**(env or {})))
    return result.returncode, time.monotonic() - start, result.stdout + result.stderr


def assert_refused(kind, code, output):
    missing, fix = broken_envs.EXPECTED[kind]
    assert code not in (0, None), output[-3000:]
    assert output.count("cannot protect this run") == 1, output[-3000:]  # one message, not one per sample
    refusal = output[output.index("cannot protect this run"):]
    assert missing in refusal.splitlines()[0], refusal
    assert "Fix: " in refusal and fix in refusal, refusal
    assert "swift_safe_media: skipped" not in output and "MediaDecodeError" not in output


@pytest.mark.parametrize("kind", KINDS)
def test_enable_in_a_script_refuses_at_once_naming_the_piece_and_the_fix(envs, kind):
    # The command line names an Omni model: ms-swift would load qwen_omni_utils for it.
    code, elapsed, output = run(envs[kind], ["python", "-c", "import swift_safe_media; swift_safe_media.enable()",
                                             *broken_envs.OMNI_ARGS])
    print(f"{kind}: refused in {elapsed:.1f} s")
    assert_refused(kind, code, output)
    assert "Traceback" not in output  # the message alone, not buried under the import machinery
    assert elapsed < SCRIPT_BOUND_S


def test_the_refusal_is_a_typed_exception_a_caller_can_catch(envs):
    code, _, output = run(envs["no_torchcodec"], ["python", "-m", "tests.programs.catch_refusal"], cwd=ROOT)
    assert code == 0, output
    assert "caught: torchcodec is not installed" in output and 'pip install "torchcodec>=0.12"' in output
    assert "protected: False env: None" in output  # nothing patched, nothing for children to inherit
    # enable() starts the warm forkserver and the zygote before it checks (their imports
    # overlap the check's): refused, it stops them and leaves CPython's forkserver as it was.
    assert re.search(r"forkserver started: \[\d+\] alive: \[\]", output), output
    assert "settings: []" in output, output
    children = ast.literal_eval(re.search(r"^children: (.*)$", output, re.M).group(1))
    assert all("resource_tracker" in child for child in children), children  # CPython's: ends with the caller
    assert "forkserver: None preload: ['__main__']" in output, output


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return scenario.build(tmp_path_factory.mktemp("preflight_swift"))


# The flag on the command line for three pieces, the environment (the start-up hook in
# `swift`'s launcher process) for the fourth.
SWIFT_CASES = [("no_torchcodec", "flag"), ("mismatched_torchcodec", "flag"), ("no_ffmpeg", "environment"),
               ("no_soundfile", "flag")]


@pytest.mark.timeout(SWIFT_BOUND_S * 2)
@pytest.mark.parametrize("kind,how", SWIFT_CASES)
def test_swift_sft_stops_before_any_worker_starts(envs, built, tmp_path, kind, how):
    argv = ["swift", "sft", *scenario.sft_args(built, str(tmp_path / "out"))]
    env = dict(scenario.RUN_ENV)
    if how == "flag":
        argv += ["--safe_media", "true", "--safe_media_timeout", "5"]
    else:
        env["SWIFT_SAFE_MEDIA"] = "1"
    code, elapsed, output = run(envs[kind], argv, env=env, timeout=SWIFT_BOUND_S * 2)
    print(f"{kind} ({how}): swift sft refused in {elapsed:.1f} s")
    assert_refused(kind, code, output)
    assert scenario.TRAIN_STARTED not in output
    assert not list((tmp_path / "out").glob("v*-*/safe_media"))  # no run folder: nothing was protected
    assert elapsed < SWIFT_BOUND_S


def test_lerobot_flag_refuses_a_torchcodec_that_cannot_load(envs):
    """LeRobot's flag parser (what `lerobot-train --safe_media=true` goes through)."""
    code, elapsed, output = run(envs["mismatched_torchcodec"],
                                ["python", "-c", "import lerobot.configs.parser", "--safe_media=true"])
    assert_refused("mismatched_torchcodec", code, output)


def test_lerobot_without_torchcodec_decodes_with_pyav_and_is_allowed(envs):
    """LeRobot falls back to PyAV when torchcodec is not installed: nothing to refuse."""
    code, _, output = run(envs["no_torchcodec"],
                          ["python", "-m", "tests.programs.lerobot_flag_parser", "--safe_media=true"], cwd=ROOT)
    assert code == 0 and "protected: True" in output, output[-3000:]


def test_children_inherit_the_verdict_and_do_not_check_again(tmp_path):
    """The parent checks once; a child process (here a plain one, as `swift sft` starts its
    training process) finds the verdict in the environment and inspects nothing."""
    code, _, output = run((sys.executable, []), ["python", "-m", "tests.programs.preflight_parent"], cwd=ROOT)
    assert code == 0, output
    assert "parent inspected: 1" in output and "inspected: 0" in output.replace("parent inspected: 1", "")
    # Without the parent's verdict the same child checks for itself.
    code, _, output = run((sys.executable, []), ["python", "-m", "tests.programs.preflight_child"], cwd=ROOT)
    assert code == 0 and "inspected: 1" in output, output


# --- doctor ---------------------------------------------------------------------------

def test_doctor_on_a_healthy_machine_shows_what_is_in_force(tmp_path):
    code, _, output = run((sys.executable, []), ["swift-safe-media", "doctor", "--safe_media_timeout", "30"],
                          env={"SWIFT_SAFE_MEDIA_STALL_TIMEOUT": "120"}, cwd=str(tmp_path))
    print(output)
    assert code == 0, output
    import torch
    import torchcodec

    assert re.search(rf"torch\s+{re.escape(torch.__version__)}\s.*\[ok\]", output)
    assert re.search(rf"torchcodec\s+{re.escape(torchcodec.__version__.split('+')[0])}\s.*loads with this torch", output)
    assert re.search(r"FFmpeg\s+\d+\.\d+.*\[ok\]", output)
    assert re.search(r"ms-swift\s+4\.\d+\.\d+, supported", output)
    assert re.search(r"SWIFT_SAFE_MEDIA_TIMEOUT\s+30\s+\(flag\)", output)
    assert re.search(r"SWIFT_SAFE_MEDIA_STALL_TIMEOUT\s+120\s+\(environment\)", output)
    assert re.search(r"SWIFT_SAFE_MEDIA_MP_CONTEXT\s+forkserver\s+\(default\)", output)
    assert re.search(r"start method\s+forkserver", output)
    assert re.search(r"confinement\s+\S", output)
    assert re.search(r"sample decode\s+ok: 8 frames of 32x32 by torchcodec, 0.25 s of sound.*first call [\d.]+ s", output)
    assert "protection can work here" in output


def test_without_audioread_a_run_of_another_model_is_warned_not_refused(envs, tmp_path):
    """qwen_omni_utils cannot load, but only Omni models need it: named, with its fix."""
    missing, fix = broken_envs.EXPECTED["no_audioread"]
    code, _, output = run(envs["no_audioread"], ["python", "-c", "import swift_safe_media; swift_safe_media.enable(); "
                                                 "print('enabled')", "--model_type", "qwen2_vl"])
    assert code == 0 and "enabled" in output and "cannot protect" not in output, output[-3000:]
    assert missing in output and fix in output, output[-3000:]
    code, _, output = run(envs["no_audioread"], ["swift-safe-media", "doctor"], cwd=str(tmp_path))
    assert code == 0, output[-3000:]
    assert re.search(r"qwen_omni_utils\s+\S+.*\[BROKEN\]", output), output
    assert f"warning: {missing}" in output and fix in output, output


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind != "no_audioread"])
def test_doctor_names_what_is_missing_and_exits_1(envs, kind, tmp_path):
    code, _, output = run(envs[kind], ["swift-safe-media", "doctor"], cwd=str(tmp_path))
    assert code == 1, output
    missing, fix = broken_envs.EXPECTED[kind]
    assert missing in output and fix in output, output
    assert re.search(r"\[(MISSING|BROKEN)\]", output), output


# --- a CUDA build mismatch this machine cannot build (torch >= 2.11 for CUDA 12.8, or CPU-only) ----

CUDA13_ERROR = ("/venv/torchcodec/libtorchcodec_core7.so: libnvrtc.so.13: cannot open shared object file: "
                "No such file or directory")
TORCH_CPU_ERROR = "/venv/torchcodec/libtorchcodec_core7.so: libc10_cuda.so: cannot open shared object file"


@pytest.mark.parametrize("torch_version,cuda,error,build,index", [
    ("2.12.0+cu128", "12.8", CUDA13_ERROR, "torch 2.12.0+cu128 is built for CUDA 12.8", "cu128"),
    ("2.12.0+cpu", None, TORCH_CPU_ERROR, "torch 2.12.0+cpu is a CPU-only build", "cpu"),
])
def test_a_cuda_build_mismatch_of_a_stable_abi_torch_points_at_the_build_for_its_cuda(torch_version, cuda, error,
                                                                                      build, index):
    """From torch 2.11 on any torchcodec >= 0.12 fits, but PyPI's links PyPI's torch's CUDA:
    the fix is the build for this torch's CUDA, from PyTorch's index."""
    from swift_safe_media.checks import preflight

    found = preflight._cuda_mismatch(preflight.Finding("torchcodec", "0.17.0"), preflight.Finding("torch", torch_version),
                                     cuda, preflight.torchcodec_requirement(torch_version), [(7, error)])
    assert found.problem.startswith("CUDA build mismatch: torchcodec 0.17.0 is built for CUDA") and build in found.problem
    assert "not the release" not in found.problem  # 0.17 fits this torch's ABI
    assert found.fix.endswith(f'-m pip install "torchcodec>=0.12" --force-reinstall --index-url '
                              f'https://download.pytorch.org/whl/{index}'), found.fix
    assert preflight._cuda_mismatch(preflight.Finding("torchcodec", "0.17.0"), preflight.Finding("torch", torch_version),
                                    cuda, "torchcodec>=0.12", [(7, "libavutil.so.59: cannot open shared object file")]) \
        is None  # FFmpeg's libraries missing: not a CUDA matter
