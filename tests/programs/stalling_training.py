"""A training loop stuck for good: the stall watchdog must dump every process, then abort.

``python -m tests.programs.stalling_training [warm]`` installs the watchdog (configured by the
``SWIFT_SAFE_MEDIA_STALL_*`` environment; with ``warm``, through ``enable()``, whose warm
forkserver then starts the workers and whose shared zygote forks the sandboxes) and
iterates a 2-worker spawn DataLoader over
``StallingDataset``, whose items hang in native calls that hold the GIL (one in a worker,
one in a sandbox), printing ``batch ITEM`` for each batch; logs go to stderr as ``LOG ...``.
"""

from __future__ import annotations

import logging


def main(warm: bool) -> None:
    import torch.utils.data
    import swift_safe_media
    from swift_safe_media import config
    from swift_safe_media.records import watchdog
    from tests.loader_datasets import StallingDataset

    logging.basicConfig(level=logging.INFO, format="LOG %(message)s")
    if warm:
        swift_safe_media.enable(hosts=[])
    else:
        watchdog.install()
    loader = torch.utils.data.DataLoader(StallingDataset(), batch_size=None, num_workers=2,
                                         multiprocessing_context=config.mp_context() if warm else "spawn")
    for item in loader:
        print("batch", item, flush=True)


if __name__ == "__main__":
    import sys

    main(warm=sys.argv[1:] == ["warm"])
