"""LLaMA-Factory's DataLoader workers under protection: their start method, and what a
worker started by the warm forkserver receives of the collator.

LLaMA-Factory has no start-method setting: its workers fork from the trainer. Under
protection they start from the warm forkserver (``SWIFT_SAFE_MEDIA_MP_CONTEXT``; a start
method named on the DataLoader, or ``default``, is left alone), which pickles the collator
to each worker. The Qwen-VL and Omni collators hold the model, only to compute the rope
index (``get_rope_index``, which reads the config and the vision tower's dtype): a worker
gets a copy of the model on the meta device in its place (its structure, config and dtypes,
no weights: kilobytes, built once a run), so the whole model is never sent. A model whose
class is not transformers' own (``trust_remote_code``), or that cannot be built so, keeps
the stock way: those workers fork from the trainer (one warning). Their decodes still run
in sandboxes of the clean zygote.
"""

from __future__ import annotations

import logging

from ... import config

log = logging.getLogger("swift_safe_media")

_meta_copies: dict[int, object] = {}  # id(model): its copy on the meta device, or None
_announced: set[str] = set()


def worker_start_method(loader) -> str | None:
    """The start method of a DataLoader that collates with LLaMA-Factory's collator and
    names none: ours, or fork where the collator's model cannot be replaced by a meta copy."""
    if loader.multiprocessing_context is not None:
        return None  # named by the user
    collator = _collator_of(loader)
    if collator is None:
        return None
    method = config.mp_context()
    if method == "default":
        return None
    model = getattr(collator, "model", None)
    if model is not None and method != "fork" and meta_copy(model) is None:
        _announce(f"LLaMA-Factory's collator holds a {type(model).__name__} that cannot be sent to workers "
                  f"without its weights: its DataLoader workers fork from the trainer, as stock's do")
        return "fork"
    _announce(f"DataLoader workers use the {method!r} start method")
    return method


def _collator_of(loader):
    collator = getattr(loader, "collate_fn", None)
    collator = getattr(collator, "data_collator", collator)  # transformers' RemoveColumnsCollator
    return collator if type(collator).__module__.startswith("llamafactory.") else None


def meta_copy(model):
    """``model``'s structure on the meta device, with its config and dtype; None: not possible."""
    key = id(model)
    if key not in _meta_copies:
        _meta_copies[key] = _build_meta_copy(model)
    return _meta_copies[key]


def _build_meta_copy(model):
    if not type(model).__module__.startswith("transformers."):
        return None
    try:
        import torch

        with torch.device("meta"):
            try:
                return type(model)._from_config(model.config, dtype=model.dtype)
            except TypeError:  # transformers before 4.56 names it torch_dtype
                return type(model)._from_config(model.config, torch_dtype=model.dtype)
    except Exception as exc:  # fail open: the workers fork instead
        log.warning("swift_safe_media: cannot build %s on the meta device (%s)", type(model).__name__, exc)
        return None


def collator_state_for_workers(collator) -> dict:
    """The collator's ``__getstate__``: as pickled to a spawned or forkserver worker, its
    model is the meta copy, and the rope function that copy's own method."""
    from multiprocessing.context import get_spawning_popen

    state = collator.__dict__.copy()
    model = state.get("model")
    copy = meta_copy(model) if model is not None and get_spawning_popen() is not None else None
    if copy is None:
        return state
    state["model"] = copy
    rope = state.get("get_rope_func")
    owner = getattr(rope, "__self__", None)
    if owner is model:
        state["get_rope_func"] = getattr(copy, rope.__name__)
    elif owner is not None and owner is getattr(model, "model", None):
        state["get_rope_func"] = getattr(copy.model, rope.__name__)
    return state


def _announce(message: str) -> None:
    if message not in _announced:
        _announced.add(message)
        log.warning("swift_safe_media: %s", message)
