"""A trainer with tokens in its environment under the warm start: its shared zygote is
forked from the warm forkserver, which holds that environment.

``python -m tests.programs.warm_secrets`` prints one JSON object: how the zygote started,
whether its initial environment block (read from here, as the trainer may) still holds a
token, and what its sandbox holds (``secrets_attacks.sandbox_environment``)."""

from __future__ import annotations

import json
import os

import swift_safe_media
from swift_safe_media import call, process

from tests import secrets_attacks


def main() -> None:
    swift_safe_media.enable(hosts=[])
    owner = process.current().shared_zygote
    owner.ready.wait(180)
    sandbox = call(secrets_attacks.sandbox_environment)
    with open(f"/proc/{owner.pid}/environ", "rb") as block:
        zygote_block = block.read()
    print(json.dumps({"started_by": getattr(owner.started_by, "__name__", None), "problem": owner.problem,
                      "zygote": owner.pid, "sandbox_parent": sandbox["ppid"],
                      "zygote_block_bytes": len(zygote_block),
                      "zygote_block_has_token": any(value.encode() in zygote_block
                                                    for name, value in os.environ.items()
                                                    if name in secrets_attacks.TOKEN_NAMES),
                      "sandbox": sandbox}))


if __name__ == "__main__":
    main()
