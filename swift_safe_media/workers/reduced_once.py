"""A tokenizer's state computed once while a DataLoader starts its workers, not once a pickle.

Workers that do not fork from the trainer receive the dataset, ``collate_fn`` and
``worker_init_fn`` pickled: one pickle a worker, after the start check's own pickle of the same
objects (``spawn_guard.pickle_noting_main``). Where a host's dataset or collator holds a Hugging
Face fast tokenizer, that is most of each pickle: the Rust ``tokenizers.Tokenizer`` writes its
whole vocabulary and merges as JSON in ``__getstate__`` (3.9 MB for Qwen2.5's vocabulary), three
times before a loader's second worker could start, all in the trainer, one after the other.

While a loader starts its workers (:func:`reduced_once`, around ``DataLoader._get_iterator``),
the reduction of such an object (what ``__reduce_ex__`` returns: the class, its arguments and
that state) is kept the first time it is pickled and given again for the same object, through
``copyreg.dispatch_table``, which the check's pickler reads and multiprocessing's
``ForkingPickler`` copies as each pickle begins. The bytes written are those pickle writes
without it; a tokenizer that cannot be pickled (a component written in Python) raises as
before, and nothing is kept for it. A type that already has a reducer there keeps it.

The object is held until the start ends, so its id names it alone. A thread that changed the
tokenizer while the loader starts its workers would have them get the state as it was at the
first pickle of that start, as forked workers get the trainer's memory as it is at each fork.
"""

from __future__ import annotations

import contextlib
import copyreg
import pickle
import sys

# (module, class) of the objects whose reduction is kept for a start: costly to reduce, and
# not changed while a loader starts its workers.
KEPT_TYPES = (("tokenizers", "Tokenizer"),)


class KeptReductions:
    """The reducer put in ``copyreg.dispatch_table`` for a start; ``computed`` and ``given``
    count the reductions made and those given again."""

    def __init__(self):
        self._by_id: dict[int, tuple[object, object]] = {}
        self.computed = self.given = 0

    def __call__(self, obj):
        kept = self._by_id.get(id(obj))
        if kept is None:
            kept = (obj, obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL))
            self._by_id[id(obj)] = kept
            self.computed += 1
        else:
            self.given += 1
        return kept[1]


def costly_types() -> list[type]:
    """The classes of :data:`KEPT_TYPES` already imported (``workers.loaded_ahead`` holds their objects ahead)."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in KEPT_TYPES)
    return [kind for kind in found if isinstance(kind, type)]


def _kept_types() -> list[type]:
    return [kind for kind in costly_types() if kind not in copyreg.dispatch_table]


@contextlib.contextmanager
def reduced_once():
    """Within: each object of :data:`KEPT_TYPES` (those already imported) is reduced once."""
    kept, kinds = KeptReductions(), _kept_types()
    for kind in kinds:
        copyreg.dispatch_table[kind] = kept
    try:
        yield kept
    finally:
        for kind in kinds:
            if copyreg.dispatch_table.get(kind) is kept:
                del copyreg.dispatch_table[kind]
