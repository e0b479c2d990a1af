"""A bad sample of a user's own map-style ``Dataset`` replaced by another, as the hosts do.

``swift_safe_media.skip_bad_samples(dataset)`` wraps a dataset: a sample whose decode
raises :class:`..errors.MediaDecodeError` (a timeout in a DataLoader worker included:
:mod:`.decode_deadline`) is logged once, naming the file and the reason, and replaced by
another sample chosen from its index alone, so every rank, worker and rerun chooses the
same one and the epoch keeps its length. Any other exception is the user's and
propagates. An ``IterableDataset`` cannot be wrapped so (a stream that raised cannot go
on): its own error handler decides (webdataset's ``handler=``, say).
"""

from __future__ import annotations

import logging
import random

from ..errors import MediaDecodeError

log = logging.getLogger("swift_safe_media")

TRIES = 10  # replacements tried for one sample before its last error is raised


class SkippingBadSamples:
    """``dataset`` whose samples that fail to decode are replaced by others."""

    def __init__(self, dataset, tries: int = TRIES):
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError(f"skip_bad_samples wraps a map-style dataset (with __getitem__ and __len__), "
                            f"not {type(dataset).__name__}")
        self.dataset, self.tries = dataset, tries

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        tried = index
        for attempt in range(self.tries + 1):
            try:
                return self.dataset[tried]
            except MediaDecodeError as error:
                if attempt == self.tries:
                    raise
                replacement = random.Random(f"{index}/{attempt}").randrange(len(self.dataset))
                log.warning("swift_safe_media: sample %s failed: %s; sample %s substituted", tried, error,
                            replacement)
                tried = replacement

    def __getattr__(self, name):
        if name in ("dataset", "tries"):  # not set yet (unpickling): never the wrapped one's
            raise AttributeError(name)
        return getattr(self.dataset, name)


def skip_bad_samples(dataset, tries: int = TRIES) -> SkippingBadSamples:
    """``dataset``, whose samples that fail to decode are logged and replaced by others
    (each chosen from the failed index alone: the same on every rank and worker), at most
    ``tries`` times for one sample."""
    return SkippingBadSamples(dataset, tries)
