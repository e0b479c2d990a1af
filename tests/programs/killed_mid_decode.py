"""A trainer to be SIGKILLed while every process of it is decoding.

``python -m tests.programs.killed_mid_decode`` enables protection (warm start: a shared
zygote; the stall watchdog: its in-flight folder), prints one JSON line with its pid and
its temporary folders (once its DataLoader's iterator made the workers' folder), then iterates a 2-worker DataLoader (workers from the warm
forkserver) whose items hang in their sandboxes, and itself decodes with a hang in its own
sandbox from a thread. The caller kills it once the in-flight folder shows three decodes.
"""

from __future__ import annotations

import json
import os
import threading


def main() -> None:
    import torch.utils.data

    import swift_safe_media
    from swift_safe_media import config
    from swift_safe_media.engine import run_folders
    from tests import sandboxed
    from tests.loader_datasets import HangingDataset

    swift_safe_media.enable(hosts=[])
    loader = torch.utils.data.DataLoader(HangingDataset(), batch_size=None, num_workers=2,
                                         multiprocessing_context=config.mp_context())
    batches = iter(loader)  # its workers' decode marks have their folder now
    print(json.dumps({"pid": os.getpid(), "folders": run_folders.owned(),
                      "inflight": config.get(config.INFLIGHT_DIR)}), flush=True)
    threading.Thread(target=swift_safe_media.call, args=(sandboxed.hold_gil_on_locked_mutex,),
                     kwargs={"path": "/data/trainer.mp4", "timeout": 600}, daemon=True).start()
    for _ in batches:
        pass


if __name__ == "__main__":
    main()
