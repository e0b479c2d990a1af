"""GRPO rollouts under protection: a row whose media fail is replaced before the rollout,
as a training sample is, and by the same row on every rank.

ms-swift's GRPO trainer encodes media in the trainer, not in DataLoader workers: the
rollout engine encodes each prompt (``num_generations`` copies of it) and the trainer
encodes the completions again. A failed decode there raises through the whole step, and
the rollout has already crossed a collective (``gather_object`` of the prompts) by then,
so it cannot be retried on one rank alone. ``GRPOTrainer._rollout_samples`` is therefore
preceded by a check: each row whose media this process has not yet seen decode is encoded
once (ms-swift's own resample does the same, under ``--truncation_strategy raise``), and
a row whose media fail is replaced by a dataset row chosen from the failed row itself, so
every rank and every copy of that prompt gets the same replacement and the group of
``num_generations`` stays one prompt. The batch keeps its size on every rank.

Cost: one extra encode of a row the first time its media are seen (a decode of each file
once per run); rows whose media decoded before are not checked again.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import zlib

from ...records import summary
from ...errors import MediaDecodeError
from .inference import media_failure

log = logging.getLogger("swift_safe_media")

MEDIA_KEYS = ("images", "videos", "audios")
REPLACEMENT_TRIES = 16


class _Checked:
    """This process's knowledge: media that decoded, and failed rows' replacements."""
    good_media: set = set()
    replacements: dict = {}


def rollout_with_media_checked(stock, trainer, inputs):
    """``GRPOTrainer._rollout_samples``: the rows, each with media that decode, then stock."""
    return stock(trainer, [_row_that_decodes(trainer, row) for row in inputs])


def media_of(row: dict) -> tuple[str, ...]:
    """The media a row names (paths, URLs), in a stable order."""
    found = []
    for key in MEDIA_KEYS:
        for item in row.get(key) or ():
            if isinstance(item, dict):
                item = item.get("path") or item.get("url") or item.get("bytes")
            found.append(item if isinstance(item, str) else repr(item)[:200])
    return tuple(found)


def _row_that_decodes(trainer, row: dict) -> dict:
    media = media_of(row)
    if not media or all(item in _Checked.good_media for item in media):
        return row
    failure = _failure_of(trainer, row)
    if failure is None:
        return row
    summary.note_failed_row()
    replacement = _Checked.replacements.get(media)
    if replacement is None:
        replacement = _Checked.replacements[media] = _replacement(trainer, row, media, failure)
    return copy.deepcopy(replacement)


def _failure_of(trainer, row: dict) -> MediaDecodeError | None:
    """Encode a copy of the prompt as the rollout will: the MediaDecodeError, if its media
    fail (counted against the error budget as a training sample's is); None otherwise,
    other errors included (the rollout meets them as stock's does)."""
    from swift.utils import remove_response

    from .adapter import _BudgetSpent, _encode_within_budget

    prompt = copy.deepcopy(row)
    try:
        remove_response(prompt["messages"])
        _encode_within_budget(trainer.template.encode, prompt)
    except _BudgetSpent as spent:
        raise spent.args[0] from None
    except Exception as exc:
        return media_failure(exc)
    _Checked.good_media.update(media_of(row))
    return None


def _replacement(trainer, row: dict, media: tuple, failure: MediaDecodeError) -> dict:
    """A row of the dataset the batch came from whose media decode, chosen by a generator
    seeded with the failed row's media: the same choice on every rank, whatever each has seen."""
    dataset = trainer.train_dataset if trainer.model.training else (trainer.eval_dataset or trainer.train_dataset)
    chooser = random.Random(zlib.crc32(json.dumps(media).encode()))
    for _ in range(REPLACEMENT_TRIES):
        index = chooser.randrange(len(dataset))
        candidate = dict(dataset[index])
        candidate_media = media_of(candidate)
        if candidate_media != media and _failure_of(trainer, candidate) is None:
            log.warning(f"swift_safe_media: rollout row with {failure.path} replaced by dataset row {index}")
            return candidate
    raise MediaDecodeError(failure.path, f"{failure.reason}; and {REPLACEMENT_TRIES} rows tried in its place "
                                         f"failed too", failure.elapsed)
