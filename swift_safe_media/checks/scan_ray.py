"""The pre-flight scan on a Ray cluster (``swift-safe-media scan DATASET --ray [ADDRESS]``).

The driver collects the items as a local scan does and hands them to Ray as tasks of
a few items each (``num_cpus=1``: Ray runs one per CPU of the cluster, on any node).
Each task runs in a Ray worker process and checks its items exactly as a local scan
does, through that worker's own sandbox with the same timeout, so a file that hangs or
crashes costs its timeout in one sandbox and nothing more; Ray schedules, retries a
task whose worker or node died, and balances the load. The driver keeps a bounded
number of tasks in flight (millions of items never become millions of pending tasks),
puts each item's result at its place and counts it once, and feeds the same progress
bar, table, JSON report and quarantine seeding as a local scan.

Every node needs this package (and its decoders) installed in the Python that runs
Ray's workers, and the dataset at the same paths (shared storage).
"""

from __future__ import annotations

import os
import time

from .. import config
from . import scan

INSTALL_HINT = "swift-safe-media scan --ray needs Ray: pip install 'swift-safe-media[ray]'"
ITEMS_PER_TASK = 4  # small: a hanging item holds up only the few behind it in its task
TASKS_IN_FLIGHT_PER_CPU = 2  # one running, one queued on each CPU: no idle gap between tasks
TASK_RETRIES = 2  # Ray re-runs a task whose worker process or node died
# Local clusters started by a scan (no address): small, no dashboard; our sandboxes do the work.
LOCAL_CLUSTER = {"include_dashboard": False, "object_store_memory": 128 << 20}


class RayMissing(ImportError):
    pass


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(f"{INSTALL_HINT} ({exc})") from None
    return ray


def alive_nodes(ray) -> int:
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def connect(address: str | None):
    """Join the cluster at ``address`` ("auto", "HOST:PORT", "ray://HOST:10001"); without one,
    the cluster ``RAY_ADDRESS`` names, else a new local one. Returns the ``ray`` module."""
    ray = import_ray()
    if not ray.is_initialized():
        options = {"log_to_driver": False, "configure_logging": False}
        if not address and not os.environ.get("RAY_ADDRESS"):
            options.update(LOCAL_CLUSTER)
        ray.init(address=address or None, **options)
    return ray


def _settings() -> dict:
    """The driver's settings as set (raw text, the environment being their channel), for
    the workers: they run in processes Ray started, not children of the driver."""
    return {name: os.environ[name] for name in config.SETTINGS if config.is_set(name)}


def scan_items(chunk: list[tuple[int, scan.Item]], settings: dict, check) -> tuple[str, list]:
    """Runs in a Ray worker: check each item in this worker's sandbox, as a local scan does.
    Returns the node it ran on and ``(index, problem or None)`` for each item."""
    import ray

    for name, text in settings.items():
        config.put(name, text)
    config.put(config.QUARANTINE, None)  # a scan tries every file, quarantined or not
    results = [(index, scan.scan_one(item, check)) for index, item in chunk]
    return ray.get_runtime_context().get_node_id(), results


def scan_on_ray(items: list[scan.Item], address: str | None = None, progress=None,
                check=scan.decode_and_discard, parallelism: int | None = None, task_options: dict | None = None
                ) -> tuple[list[scan.Problem], float, dict]:
    """Check all items on the Ray cluster; returns the problems (sorted, as a local scan's),
    the wall time, and where the work ran: ``{"parallelism": N, "nodes": {node id: items}}``.
    ``parallelism``: at most this many tasks at once (default: every CPU of the cluster).
    ``task_options`` go to Ray's ``.options()`` of every task (custom ``resources``, say)."""
    ray = connect(address)
    started = time.monotonic()
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    parallelism = parallelism or cpus
    # A queued task per CPU keeps every CPU busy; a cap below the cluster's CPUs is exact.
    in_flight = parallelism * TASKS_IN_FLIGHT_PER_CPU if parallelism >= cpus else parallelism
    remote = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(scan_items).options(**(task_options or {}))
    settings = _settings()
    # Absolute paths on the workers (their working directory is not ours); reports keep the given ones.
    chunks = [[(index, scan.Item(os.path.abspath(item.path) if "://" not in item.path else item.path, item.kind))
               for index, item in enumerate(items[start:start + ITEMS_PER_TASK], start)]
              for start in range(0, len(items), ITEMS_PER_TASK)]
    seen = [False] * len(items)
    nodes: dict[str, int] = {}
    problems: list[scan.Problem] = []
    pending, next_chunk, done = {}, 0, 0
    while next_chunk < len(chunks) or pending:
        while next_chunk < len(chunks) and len(pending) < in_flight:
            pending[remote.remote(chunks[next_chunk], settings, check)] = next_chunk
            next_chunk += 1
        [finished], _ = ray.wait(list(pending), num_returns=1)
        chunk = chunks[pending.pop(finished)]
        try:
            node, chunk_results = ray.get(finished)
        except ray.exceptions.RayError as exc:
            # Retries spent (a node lost again and again, say): its items are reported, not dropped.
            reason = f"the Ray task failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
            node, chunk_results = "unknown", [(index, scan.Problem(item.path, item.kind, reason, 0.0))
                                              for index, item in chunk]
        nodes[node] = nodes.get(node, 0) + len(chunk_results)
        for index, problem in chunk_results:
            if seen[index]:
                raise RuntimeError(f"item {index} ({items[index].path}) came back twice")
            seen[index] = True
            if problem is not None:
                problem.path = items[index].path
                problems.append(problem)
        done += len(chunk_results)
        if progress is not None:
            progress(done, len(items), len(problems), time.monotonic() - started)
    if not all(seen):
        raise RuntimeError(f"{seen.count(False)} items never came back from the cluster")
    return (sorted(problems, key=lambda problem: problem.path), time.monotonic() - started,
            {"parallelism": parallelism, "nodes": nodes})
