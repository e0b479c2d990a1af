"""Decode clips through ms-swift's InternVL loader, protected, round after round, as a
user's loop would: ``python -m tests.programs.decode_loop ROUNDS CLIP...``. Prints one
JSON line: the number of frames each decode gave (by clip), and every failure (type:
message). The environment sets the timeout, the registry and the rest; with
``DECODE_LOOP_WHILE`` naming a file, rounds go on past ROUNDS while that file exists (a test
that kills processes of the loop keeps it busy until it is done, however fast this machine)."""

import json
import os
import sys
import time


def main() -> None:
    from swift_safe_media import MediaDecodeError, shutdown
    from swift_safe_media.decoders import load_video_internvl

    rounds, clips = int(sys.argv[1]), sys.argv[2:]
    decoded, failures, seconds = {clip: [] for clip in clips}, [], []
    keep_going = os.environ.get("DECODE_LOOP_WHILE")
    done_rounds = 0
    while done_rounds < rounds or (keep_going and os.path.exists(keep_going)):
        done_rounds += 1
        for clip in clips:
            started = time.monotonic()
            try:
                decoded[clip].append(len(load_video_internvl(clip, num_segments=8)))
            except MediaDecodeError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            seconds.append(time.monotonic() - started)
    shutdown()
    print(json.dumps({"decoded": decoded, "failures": failures, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
