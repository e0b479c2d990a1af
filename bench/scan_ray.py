"""``scan --ray`` against a local ``scan --workers N`` on the same machine, side by side.

Local: ``swift_safe_media.checks.scan`` with N sandboxes in this process. Ray: the same items
as Ray tasks on a local cluster of N CPUs (one sandbox per Ray worker). Both warmed up
first, then measured in alternating rounds; the ratio is Ray's items/s over local's.

``--scaling``: items/s with 1, 2, ... simulated nodes (``ray.cluster_utils.Cluster``,
one CPU each) on this machine, whose CPU count bounds what more nodes can add here.

    .venv/bin/python bench/scan_ray.py [--workers 2] [--clips 16] [--rounds 5] [--scaling]
"""

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray

from swift_safe_media.checks import scan, scan_ray
from swift_safe_media import shutdown

SMALL = {"object_store_memory": 80 << 20, "include_dashboard": False}


def load_corpus_maker():
    spec = importlib.util.spec_from_file_location("bench_scan", Path(__file__).with_name("scan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_corpus


def local(items, workers) -> float:
    problems, elapsed = scan.scan(items, workers)
    assert not problems, problems
    return len(items) / elapsed


def on_ray(items, workers, task_options=None) -> float:
    problems, elapsed, _ = scan_ray.scan_on_ray(items, parallelism=workers, task_options=task_options)
    assert not problems, problems
    return len(items) / elapsed


def spread(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def compare(items, workers, rounds) -> None:
    ray.init(num_cpus=workers, log_to_driver=False, **SMALL)
    try:
        local(items[:workers * 4], workers)  # warm: zygote, sandboxes, imports
        on_ray(items[:workers * 4], workers)  # warm: Ray workers, their zygotes and sandboxes
        local_rates, ray_rates = [], []
        for _ in range(rounds):  # alternating, so both see the same load
            local_rates.append(local(items, workers))
            ray_rates.append(on_ray(items, workers))
    finally:
        ray.shutdown()
        shutdown()
    ratios = [r / l for r, l in zip(ray_rates, local_rates)]
    print(f"## scan --ray vs scan --workers {workers}, {len(items)} items, {os.cpu_count()} CPUs, "
          f"median (min-max) of {rounds} alternating rounds")
    print("| mode | items/s |\n|---|---|")
    print(f"| scan --workers {workers} | {spread(local_rates)} |")
    print(f"| scan --ray (local cluster, {workers} CPUs) | {spread(ray_rates)} |")
    print(f"\nray / local throughput: {spread(ratios)}x per round (target >= 0.90x)")


def scaling(items, max_nodes, rounds) -> None:
    """One cluster of ``max_nodes`` one-CPU nodes; a round with k nodes sends its tasks to the
    first k only (node i holds the custom resources "up_to_<k>" for every k > i), and the
    node counts alternate round by round, so all see the same load."""
    from ray.cluster_utils import Cluster

    def labels(index):
        return {f"up_to_{k}": 1.0 for k in range(index + 1, max_nodes + 1)}

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": labels(0), **SMALL})
    rates = {nodes: [] for nodes in range(1, max_nodes + 1)}
    try:
        for index in range(1, max_nodes):
            cluster.add_node(num_cpus=1, resources=labels(index), object_store_memory=SMALL["object_store_memory"])
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        for nodes in rates:  # warm every node's Ray workers and sandboxes
            on_ray(items[:nodes * 4], nodes, {"resources": {f"up_to_{nodes}": 0.01}})
        for _ in range(rounds):
            for nodes in rates:
                rates[nodes].append(on_ray(items, nodes, {"resources": {f"up_to_{nodes}": 0.01}}))
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"\n## scan --ray with simulated nodes (1 CPU each) on this {os.cpu_count()}-CPU machine, "
          f"{len(items)} items, median (min-max) of {rounds} alternating rounds")
    print("| nodes | items/s | vs 1 node, per round |\n|---|---|---|")
    for nodes, values in rates.items():
        print(f"| {nodes} | {spread(values)} | {spread([v / one for v, one in zip(values, rates[1])])}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scaling", action="store_true", help="also items/s with 1..--max-nodes simulated nodes")
    parser.add_argument("--max-nodes", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        items = load_corpus_maker()(Path(folder), args.clips)
        compare(items, args.workers, args.rounds)
        if args.scaling:
            scaling(items, args.max_nodes, args.rounds)


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"\n(bench took {time.monotonic() - started:.0f} s)")
