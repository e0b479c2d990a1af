"""A bad file in LLaMA-Factory, handled its way: dropped at preprocessing, substituted at
collation.

- Preprocessing (``*DatasetProcessor.preprocess_dataset``, run by ``datasets.map`` over
  batches of rows): a row whose media fail is dropped from the processed dataset, as
  LLaMA-Factory drops an invalid example, with one warning naming the file and the
  reason. The batch is encoded again without the rows that hold the file (so packing and
  pairing see only good rows); the file is quarantined, so it is refused at once after.
- Collation (``MultiModalDataCollatorForSeq2Seq.__call__`` and its subclasses'): a
  sample whose media fail (a file changed since preprocessing, a decode that timed out
  this time) is replaced by a row of the training dataset drawn from the sample (else by
  another sample of its batch), so every rank still gets a full batch and the same number
  of batches. Only the outermost collator call
  substitutes (the pairwise collator hands its chosen and rejected halves to the base
  class: a pair is replaced whole).

Both count against the error budget (:mod:`swift_safe_media.records.budget`).
"""

from __future__ import annotations

import contextvars
import logging
import random

from ...records.budget import process_budget
from ...errors import short_reason
from .decode import failed_path, media_name

log = logging.getLogger("swift_safe_media")

ROW_MEDIA = ("_images", "_videos", "_audios")  # LLaMA-Factory's aligned columns
FEATURE_MEDIA = ("images", "videos", "audios")  # what the processed rows carry to the collator


def _files(value) -> set[str]:
    """The files a row's media value names (a list of items; a video may be a list of frames)."""
    if value is None:
        return set()
    if not isinstance(value, (list, tuple)):
        value = [value]
    files = set()
    for item in value:
        if isinstance(item, (list, tuple)):
            files |= _files(item)
        else:
            name = media_name(item)
            if name is not None:
                files.add(name)
    return files


def _reason(exc: BaseException) -> str:
    return getattr(exc, "reason", None) or short_reason(exc)


# -- preprocessing ------------------------------------------------------------------------------
def preprocess_dropping_bad_rows(stock, processor, examples):
    """``preprocess_dataset`` over the batch without the rows whose media fail."""
    rows = None
    while True:
        try:
            return stock(processor, examples if rows is None else rows)
        except Exception as exc:
            path = failed_path(exc)
            if path is None:
                raise
            if rows is None:
                rows = {key: list(examples[key]) for key in examples.keys()}
            bad = [index for index in range(_row_count(rows))
                   if any(path in _files(rows[column][index]) for column in ROW_MEDIA if column in rows)]
            if not bad:
                raise  # the failure names no file of these rows: not ours to drop
            reason = _reason(exc)
            log.warning("swift_safe_media: dropped %d row%s from the dataset: %s: %s",
                        len(bad), "" if len(bad) == 1 else "s", path, reason)
            budget = process_budget()
            for _ in bad:
                budget.failure(f"{path}: {reason}")
            keep = set(range(_row_count(rows))) - set(bad)
            rows = {key: [value for index, value in enumerate(values) if index in keep]
                    for key, values in rows.items()}


def _row_count(rows: dict) -> int:
    return len(next(iter(rows.values()))) if rows else 0


# -- collation ----------------------------------------------------------------------------------
_collating = contextvars.ContextVar("swift_safe_media_llamafactory_collating", default=False)


def collate_or_substitute(stock, collator, features):
    """The collator's ``__call__``; a sample whose media fail is replaced by another of the batch."""
    if _collating.get():
        return stock(collator, features)  # a subclass's call, inside the outermost one
    marker = _collating.set(True)
    try:
        return _collate(stock, collator, list(features))
    finally:
        _collating.reset(marker)


def _collate(stock, collator, features):
    budget = process_budget()
    failed: dict[str, str] = {}  # file: reason, in the order met
    while True:
        try:
            # The collator pops each sample's media: a retry needs them still there.
            batch = stock(collator, [dict(feature) if isinstance(feature, dict) else feature for feature in features])
        except Exception as exc:
            path = failed_path(exc)
            if path is None or path in failed:
                raise
            failed[path] = _reason(exc)
            budget.failure(f"{path}: {failed[path]}")
            features = _substituted(collator, features, failed)
            continue
        for _ in features:
            budget.success()
        return batch


# -- where stand-ins come from ------------------------------------------------------------------
ROWS_ATTRIBUTE = "_swift_safe_media_rows"  # the training dataset, on the collator that reads it
_DRAWS = 64  # rows of the dataset tried for one stand-in before the batch's own


def remember_rows(loader) -> None:
    """Give the collator of ``loader`` its dataset, to draw stand-ins from (called as training
    begins). A loader with workers is left as it was made: each worker draws from its own
    dataset, the loader's (:func:`_rows`), and the collator the workers are sent stays the
    one a holding server may have unpickled ahead (:mod:`...workers.held_arguments`)."""
    if getattr(loader, "num_workers", 0):
        return
    collator = getattr(loader, "collate_fn", None)
    collator = getattr(collator, "data_collator", collator)  # transformers' RemoveColumnsCollator
    dataset = getattr(loader, "dataset", None)
    if collator is not None and dataset is not None and type(collator).__module__.startswith("llamafactory."):
        try:
            setattr(collator, ROWS_ATTRIBUTE, dataset)
        except AttributeError:
            pass


def _is_bad(feature, failed) -> bool:
    return isinstance(feature, dict) and any(_files(feature.get(key)) & failed.keys() for key in FEATURE_MEDIA)


def _substituted(collator, features: list, failed: dict[str, str]) -> list:
    """``features`` with each sample that names a failed file replaced: by a row of the
    training dataset drawn from the file and the sample's place in the batch (the same on
    every rank and run), else by the next good sample of the batch."""
    named = "; ".join(f"{path}: {reason}" for path, reason in failed.items())
    replaced = list(features)
    for index, feature in enumerate(features):
        if not _is_bad(feature, failed):
            continue
        stand_in, where = _drawn(collator, feature, index, failed), "a row of the dataset"
        if stand_in is None:
            good = [other for other in features if not _is_bad(other, failed)]
            if not good:
                raise RuntimeError(f"swift_safe_media: no sample can stand in for sample {index} of the batch "
                                   f"({named})")
            stand_in, where = good[index % len(good)], "another sample of the batch"
        replaced[index] = stand_in
        log.warning("swift_safe_media: %s; sample %d of the batch substituted by %s", named, index, where)
    return replaced


def _rows(collator):
    """The training dataset: the collator's, else (in a DataLoader worker) the worker's."""
    rows = getattr(collator, ROWS_ATTRIBUTE, None)
    if rows is None:
        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        rows = worker.dataset if worker is not None else None
    return rows


def _drawn(collator, feature, index, failed):
    rows = _rows(collator)
    if rows is None or not len(rows):
        return None
    media = set().union(*(_files(feature.get(key)) for key in FEATURE_MEDIA))
    draw = random.Random(f"{sorted(media)}:{index}")
    for _ in range(_DRAWS):
        candidate = rows[draw.randrange(len(rows))]
        if not _is_bad(candidate, failed):
            return candidate
    return None
