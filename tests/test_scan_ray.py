"""`swift-safe-media scan --ray` on real Ray clusters on this machine: one started with
``ray.init()``, and three nodes of ``ray.cluster_utils.Cluster``. Every planted bad file
is found exactly once, the results are those of a local scan, and an item that hangs
(a FIFO behind a playlist, a native call spinning with the GIL held) or crashes its
sandbox costs its timeout in one sandbox, never the job."""

import json
import os
import re
import shutil

import pytest

import swift_safe_media
from swift_safe_media.records import quarantine
from swift_safe_media.checks import scan, scan_ray

from . import scan_checks
from .fresh import ROOT, run_python
from .test_scan import corpus, run_scan  # noqa: F401  (the planted corpus and the CLI runner)

ray = pytest.importorskip("ray")
TIMEOUT = "5"
# Small on a shared 2-core machine: our sandboxes do the work, not Ray's object store.
SMALL = {"object_store_memory": 80 << 20, "include_dashboard": False}
# A Ray worker's first item also starts its sandbox pool, on a machine Ray's nodes load.
START_SLACK = 30


def comparable(problems):
    """What must match between two scans: path, kind and reason (pids and times differ).
    Takes report problems or registry entries (their reason is the problem). The time a
    sandbox waited for a CPU (the fair clock) depends on the machine's load, not the file."""
    return sorted((p["path"], p["kind"], normalized(p.get("problem", p.get("reason")))) for p in problems)


# What a timeout's reason adds for the time its sandbox waited for a CPU (fair_clock.describe).
CPU_WAIT = re.compile(r", not counting ([\d.]+) s it waited for a CPU")


def normalized(reason: str) -> str:
    return CPU_WAIT.sub("", re.sub(r"pid \d+", "pid N", reason))


def bounded(problem: str, elapsed: float) -> bool:
    """An item costs at most its timeout and its sandbox's start, plus what the fair clock
    added for time the sandbox waited for a CPU (the reason says how much; a loaded
    machine may add up to the timeout's ceiling)."""
    waited = CPU_WAIT.search(problem)
    return elapsed - (float(waited.group(1)) if waited else 0.0) < float(TIMEOUT) + START_SLACK


def table_rows(stdout):
    return sorted(re.sub(r"pid \d+", "pid N", line).rsplit("  ", 1)[0].rstrip()
                  for line in stdout.split("\n\n")[0].splitlines()[2:])


@pytest.fixture(scope="class")
def local_cluster():
    ray.init(num_cpus=2, log_to_driver=False, **SMALL)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.mark.timeout(300)
class TestOnThisMachine:
    def test_the_same_report_as_a_local_scan(self, local_cluster, corpus, tmp_path):  # noqa: F811
        folder, bad = corpus
        outcomes = {}
        for mode, flags in (("local", ["--workers", "2"]), ("ray", ["--ray", local_cluster])):
            report, registry = tmp_path / f"{mode}.json", tmp_path / mode / "quarantine.jsonl"
            done = run_scan(str(folder / "train.jsonl"), *flags, "--timeout", TIMEOUT,
                            "--report", str(report), "--quarantine", str(registry))
            assert done.returncode == 1, done.stderr
            outcomes[mode] = done, json.loads(report.read_text()), quarantine.entries(str(registry))
        (local, local_report, local_registry), (on_ray, ray_report, ray_registry) = outcomes["local"], outcomes["ray"]
        assert {os.path.basename(p["path"]) for p in ray_report["problems"]} == set(bad)
        assert comparable(ray_report["problems"]) == comparable(local_report["problems"])
        assert ray_report["scanned"] == local_report["scanned"] == 10 and ray_report["problem_count"] == len(bad)
        assert ray_report["ray"]["items_per_node"] == [10]
        assert set(local_report) | {"ray"} == set(ray_report)
        assert table_rows(on_ray.stdout) == table_rows(local.stdout)
        assert comparable(ray_registry) == comparable(local_registry) and len(ray_registry) == len(bad)
        # Bounded: the playlist's FIFO costs its timeout (an item's time may include its sandbox's start).
        assert all(bounded(problem["problem"], problem["elapsed"]) for problem in ray_report["problems"]), \
            [(problem["path"], problem["problem"], problem["elapsed"]) for problem in ray_report["problems"]]
        assert "on a Ray cluster (1 nodes)" in on_ray.stderr
        assert "10/10" in on_ray.stderr and f"problems: {len(bad)}" in on_ray.stderr  # the same progress bar
        assert f"problems: {len(bad)}" in local.stderr


def test_without_ray_the_flag_says_how_to_install_it(corpus):  # noqa: F811
    folder, _ = corpus
    done = run_python(module="tests.programs.cli_without_ray", args=["scan", folder, "--ray"], env=dict(os.environ),
                      timeout=120, check=False)
    assert done.returncode == 2
    assert "pip install 'swift-safe-media[ray]'" in done.stderr


@pytest.fixture(scope="class")
def three_nodes():
    from ray.cluster_utils import Cluster

    python_path = os.environ.get("PYTHONPATH")
    # Ray's workers inherit the raylets' environment: let them import tests.scan_checks.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, python_path]))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **SMALL})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, object_store_memory=SMALL["object_store_memory"])
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if python_path is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = python_path


@pytest.fixture
def dataset(corpus, tmp_path, spin_library):  # noqa: F811
    """24 good items and the corpus's bad ones, plus a native spin and a segfault."""
    folder, bad = corpus
    data = tmp_path / "data"
    data.mkdir()
    for copy in range(6):
        for name in ("good.wav", "good.flac", "good.mp4", "good.png"):
            shutil.copy(folder / name, data / f"{copy}-{name}")
    for name in bad:
        source = folder / name
        if source.is_fifo():
            os.mkfifo(data / name)
        elif source.is_dir():
            (data / name).mkdir()
        else:
            shutil.copy(source, data / name)
    os.mkfifo(data / "seg0.ts")
    (data / "spin.mp4").write_bytes(scan_checks.SPIN + spin_library.encode())
    (data / "segv.wav").write_bytes(scan_checks.SEGV)
    planted = set(bad) | {"seg0.ts", "spin.mp4", "segv.wav"}
    return scan.collect(str(data)), planted


@pytest.mark.timeout(300)
class TestOnThreeNodes:
    def test_split_across_nodes_found_once_as_locally(self, three_nodes, dataset, spin_library, monkeypatch):
        items, planted = dataset
        monkeypatch.setenv("SWIFT_SAFE_MEDIA_TIMEOUT", TIMEOUT)  # the workers get the driver's settings
        # The native spin is a library loaded by name: confinement would refuse it before it spins.
        monkeypatch.setenv("SWIFT_SAFE_MEDIA_READ_ROOTS", os.path.dirname(spin_library))
        swift_safe_media.shutdown()  # the local scan's zygote builds its read rules as it starts
        problems, _, where = scan_ray.scan_on_ray(
            items, check=scan_checks.decode_or_fail_natively)
        assert len(where["nodes"]) == 3 and sum(where["nodes"].values()) == len(items) == 24 + len(planted)
        assert sorted(os.path.basename(problem.path) for problem in problems) == sorted(planted)
        by_name = {os.path.basename(problem.path): problem for problem in problems}
        assert "timeout" in by_name["spin.mp4"].problem and "MediaDecodeTimeout" in by_name["spin.mp4"].problem
        assert "SIGSEGV" in by_name["segv.wav"].problem
        assert all(bounded(problem.problem, problem.elapsed) for problem in problems), \
            [(problem.path, problem.problem, problem.elapsed) for problem in problems]
        try:
            local, _ = scan.scan(items, 2, check=scan_checks.decode_or_fail_natively)
        finally:
            swift_safe_media.shutdown()
        as_dicts = [{"path": p.path, "kind": p.kind, "problem": p.problem} for p in problems]
        assert comparable(as_dicts) == comparable([{"path": p.path, "kind": p.kind, "problem": p.problem}
                                                   for p in local])
