"""A reward function for the GRPO test, loaded by the real `swift rlhf` through
`--external_plugins`: the reward is the completion's length, and each call writes, for
every completion, the rank and the media of its row to ``$GRPO_SEEN_LOG`` (what the
test checks: no bad file reaches a rollout, and every rank scores as many completions)."""

import json
import os

from swift.rewards import ORM, orms

MEDIA_KEYS = ("images", "videos", "audios")


class MediaSeen(ORM):

    def __call__(self, completions, **kwargs):
        out = os.environ.get("GRPO_SEEN_LOG")
        if out:
            with open(out, "a") as log:
                for index in range(len(completions)):
                    media = []
                    for key in MEDIA_KEYS:
                        values = kwargs.get(key)
                        if values and values[index]:
                            media += values[index]
                    log.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "media": media}) + "\n")
        return [float(len(completion)) for completion in completions]


orms["media_seen"] = MediaSeen
