"""``swift-safe-media`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="swift-safe-media",
                                     description="Bounded, isolated media decoding for training pipelines.")
    commands = parser.add_subparsers(dest="command", required=True)
    scan = commands.add_parser("scan", help="decode every media item of a dataset and report the bad ones")
    scan.add_argument("target", help="ms-swift dataset file (.jsonl/.json/.csv), LeRobot dataset root, or directory")
    scan.add_argument("--workers", type=int, default=None,
                      help="parallel sandboxes (default: half the CPUs here; with --ray, every CPU of the cluster)")
    scan.add_argument("--timeout", type=float, default=None,
                      help=f"seconds per item (default: {config.TIMEOUT} or {config.DEFAULT_TIMEOUT_S:g})")
    scan.add_argument("--report", help="write the JSON report here")
    scan.add_argument("--quarantine", help="record every problem in this quarantine registry (JSONL)")
    scan.add_argument("--no-progress", action="store_true", help="no progress bar")
    scan.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                      help="decode on a Ray cluster: ADDRESS ('auto', 'HOST:PORT', 'ray://HOST:10001'), "
                           "else the one RAY_ADDRESS names, else a new local one (pip install "
                           "'swift-safe-media[ray]')")
    add_quarantine_commands(commands)
    commands.add_parser("confinement", help="show what confines the decode sandboxes here (JSON)")
    commands.add_parser("targets", help="show every patch target and whether the installed releases still have "
                                        "it (moved, renamed, signature changed, new decode functions)")
    from .hosts.swift.adapter import FLAGS  # the flags ms-swift and LeRobot take, parsed the same way
    doctor = commands.add_parser("doctor", parents=[FLAGS], help="show what is installed and in force; "
                                 "exit 1 when protection cannot work here (takes the hosts' --safe_media_* flags)")
    doctor.add_argument("--script", metavar="TRAIN_PY",
                        help="instead, read this training script (without running it) and name the media openers "
                             "its DataLoader reaches that enable() does not bound, as enable() logs them")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command == "confinement":
        return show_confinement()
    if args.command == "doctor":
        return run_doctor(args)
    if args.command == "targets":
        from .checks import targets

        return targets.report()
    if args.command == "quarantine":
        return run_quarantine(args)
    return run_scan(args)


def add_quarantine_commands(commands) -> None:
    parser = commands.add_parser("quarantine", help="see the quarantine registry's entries, decode them again, "
                                                    "drop the ones that decode or that you name")
    actions = parser.add_subparsers(dest="action", required=True)
    where = dict(nargs="?", default=None, help=f"the registry (default: {config.QUARANTINE})")
    actions.add_parser("list", help="the files the registry refuses, and why").add_argument("registry", **where)
    recheck = actions.add_parser("recheck", help="decode every refused file again with a longer timeout and "
                                                 "forget the ones that decode")
    recheck.add_argument("registry", **where)
    recheck.add_argument("--timeout", type=float, default=None,
                         help="seconds per file (default: 4 times SWIFT_SAFE_MEDIA_TIMEOUT)")
    recheck.add_argument("--workers", type=int, default=1, help="files decoded at once (default: 1)")
    forget = actions.add_parser("forget", help="stop refusing the files named (or --all)")
    forget.add_argument("registry", **where)
    forget.add_argument("paths", nargs="*", help="files to forget")
    forget.add_argument("--all", action="store_true", help="every file the registry refuses")


def run_quarantine(args) -> int:
    """``quarantine list | recheck | forget``: what a user does with files refused."""
    from .records import quarantine

    path = args.registry or config.get(config.QUARANTINE)
    if not path:
        print(f"swift-safe-media quarantine: name the registry (or set {config.QUARANTINE})", file=sys.stderr)
        return 2
    registry = quarantine.Registry(path)
    entries = registry.current()
    if args.action == "list":
        for entry in sorted(entries, key=lambda entry: entry["path"]):
            changed = "" if registry.lookup(entry["path"]) is entry else "  (changed since: not refused)"
            print(f"{entry['path']}  {entry['kind']}  {entry['time']} {entry['host']} rank {entry['rank']}: "
                  f"{entry['reason']}{changed}")
        print(f"{len(entries)} quarantined", file=sys.stderr)
        return 0
    if args.action == "forget":
        named = [entry["path"] for entry in entries] if args.all else args.paths
        forgotten = [path for path in named if registry.forget(path)]
        print(f"forgot {len(forgotten)} of {len(named)}: {', '.join(forgotten)}", file=sys.stderr)
        return 0 if len(forgotten) == len(named) else 1
    return recheck_quarantine(registry, entries, args)


def recheck_quarantine(registry, entries, args) -> int:
    """Decode each refused, unchanged file again (the pre-flight scan's checks), with a
    longer timeout; forget those that decode. Exit 1 while any still fails."""
    from .checks import scan
    from . import shutdown

    config.write(timeout=args.timeout or 4 * config.timeout())
    config.put(config.QUARANTINE, None)  # the files are tried whether refused or not
    items = [scan.Item(entry["path"], scan.kind_of(entry["path"]) or "video") for entry in entries
             if registry.lookup(entry["path"]) is entry]
    try:
        problems, _ = scan.scan(items, max(1, args.workers))
    finally:
        shutdown()
    failing = {problem.path: problem for problem in problems}
    for item in items:
        if item.path in failing:
            print(f"still fails: {item.path}: {failing[item.path].problem}")
        elif registry.forget(item.path):
            print(f"decodes now, forgotten: {item.path}")
    return 1 if failing else 0


def show_confinement() -> int:
    """The settings and kernel support, and what a real sandbox reads back from its kernel."""
    from . import call, shutdown
    from .confinement import policy as confine

    from .decoders import stock

    found = confine.status()
    found["decode_paths"] = stock.decode_paths(found["enabled"], bool((found.get("reads") or {}).get("limited")))
    try:
        found["sandbox"] = call(confine.status_here, timeout=config.start_timeout())
    finally:
        shutdown()
    print(json.dumps(found, indent=2))
    return 0


def run_doctor(args) -> int:
    from .checks import doctor

    if args.script:
        return doctor.report_script(args.script)
    try:
        config.write(source="flag", timeout=args.safe_media_timeout, max_memory_mb=args.safe_media_max_memory_mb,
                     mp_context=args.safe_media_mp_context, quarantine=args.safe_media_quarantine,
                     stall_timeout=args.safe_media_stall_timeout, stall_action=args.safe_media_stall_action)
    except ValueError as exc:
        print(f"swift-safe-media doctor: {exc}", file=sys.stderr)
        return 2
    return doctor.report()


def run_scan(args) -> int:
    from .checks import preflight, scan
    from .records import quarantine
    from . import shutdown
    from .errors import ProtectionUnavailable

    if args.timeout is not None:
        config.write(timeout=args.timeout)
    try:
        preflight.require()  # one clear refusal, not one failure per item
    except ProtectionUnavailable as exc:
        print(f"swift-safe-media scan: {exc}", file=sys.stderr)
        return 2
    config.put(config.QUARANTINE, None)  # a scan tries every file, quarantined or not
    try:
        items = scan.collect(args.target)
    except (OSError, ValueError) as exc:
        print(f"swift-safe-media scan: {exc}", file=sys.stderr)
        return 2
    where = None
    if args.ray is not None:
        from .checks import scan_ray

        try:
            ray = scan_ray.connect(args.ray or None)
        except (scan_ray.RayMissing, ConnectionError, RuntimeError) as exc:
            print(f"swift-safe-media scan: {exc}", file=sys.stderr)
            return 2
        workers = args.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        print(f"scanning {len(items)} media items from {args.target} on a Ray cluster "
              f"({scan_ray.alive_nodes(ray)} nodes) with {workers} workers", file=sys.stderr)
    else:
        workers = args.workers or max(1, (os.cpu_count() or 2) // 2)
        print(f"scanning {len(items)} media items from {args.target} with {workers} workers", file=sys.stderr)
    progress = None if args.no_progress or not items else scan.ProgressBar(len(items))
    try:
        if args.ray is not None:
            problems, elapsed, where = scan_ray.scan_on_ray(items, args.ray or None, progress, parallelism=workers)
        else:
            problems, elapsed = scan.scan(items, workers, progress)
    finally:
        if progress is not None:
            progress.close()
        if args.ray is not None:
            ray.shutdown()  # leaves a cluster it joined running; stops one it started
    shutdown()
    print(scan.format_table(problems))
    summary = scan.report(items, problems, elapsed, workers, config.timeout())
    if where is not None:
        summary["ray"] = {"nodes": len(where["nodes"]), "items_per_node": sorted(where["nodes"].values())}
    print(f"\n{len(items)} scanned, {len(problems)} with problems, {elapsed:.1f} s "
          f"({summary['items_per_s'] or 0:.1f} items/s)")
    if args.report:
        with open(args.report, "w") as out:
            json.dump(summary, out, indent=2)
    if args.quarantine:
        registry = quarantine.Registry(args.quarantine)
        for problem in problems:
            registry.record(problem.path, "scan", problem.problem, problem.elapsed)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
