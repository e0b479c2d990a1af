"""``disable()`` undoes what ``enable()`` did for the stall watchdog.

``python -m tests.programs.watchdog_disable`` (with ``SWIFT_SAFE_MEDIA_STALL_TIMEOUT`` set)
prints two lines of booleans:

1. after ``enable()``: DataLoader's ``__next__`` is patched, the watchdog thread runs,
   the in-flight folder exists;
2. after ``disable()``: ``__next__`` is torch's again, a watchdog thread is still alive,
   the in-flight folder still exists, ``SWIFT_SAFE_MEDIA_INFLIGHT_DIR`` is still set.
"""

from __future__ import annotations

import os
import threading


def main() -> None:
    import swift_safe_media
    from torch.utils.data import dataloader

    stock = dataloader._BaseDataLoaderIter.__next__
    swift_safe_media.enable(hosts=["swift"])
    folder = os.environ["SWIFT_SAFE_MEDIA_INFLIGHT_DIR"]
    watching = [t.name for t in threading.enumerate() if t.name == "swift-safe-media-watchdog"]
    print(dataloader._BaseDataLoaderIter.__next__ is not stock, watching != [], os.path.isdir(folder))
    swift_safe_media.disable()
    watching = [t for t in threading.enumerate() if t.name == "swift-safe-media-watchdog"]
    for thread in watching:
        thread.join(5)
    print(dataloader._BaseDataLoaderIter.__next__ is stock, any(t.is_alive() for t in watching),
          os.path.isdir(folder), "SWIFT_SAFE_MEDIA_INFLIGHT_DIR" in os.environ)


if __name__ == "__main__":
    main()
