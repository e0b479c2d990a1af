"""Named in ``SWIFT_SAFE_MEDIA_WORKER_PRELOAD`` by tests/test_forked_forkserver.py: each process
that imports it adds a line to the file ``IMPORTED_AHEAD_LOG`` names (its pid, when, and
whether the warm forkserver's orders had come: their environment names protection on)."""

import json
import os
import time

with open(os.environ["IMPORTED_AHEAD_LOG"], "a") as log:
    log.write(json.dumps({"pid": os.getpid(), "at": time.monotonic(),
                          "settings_came": os.environ.get("SWIFT_SAFE_MEDIA") == "1"}) + "\n")
