"""LeRobot's DataLoader workers under protection: their start method, and the run
summary as ``lerobot-train`` draws its batches.

The start method. Workers use ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (default ``forkserver``: the
warm forkserver, a clean process as spawn gives, at fork speed; ``default`` leaves
LeRobot's choice alone) unless the start method is the user's own choice:

- LeRobot 0.6.1 on (``TrainPipelineConfig.dataloader_multiprocessing_context``, default
  spawn): ``lerobot-train``'s training and eval loaders get ours only while the value is
  LeRobot's own default, not one the user named (on the command line, or in a config file
  other than a checkpoint's own saved config that ``--resume`` reads). draccus leaves
  no trace of where a value came from, so the command line and the file are read here.
- LeRobot 0.4 - 0.6.0 (no such setting; their workers fork): the loaders ``cycle`` draws
  from (``lerobot-train``'s training loader) and the loaders of LeRobot's datasets (0.6's
  eval loader, iterated with a plain ``for``) get ours, unless the DataLoader names a
  start method itself.

The method is set where torch starts the workers (:mod:`...workers.start`), on the torch
DataLoader that really runs them: ``lerobot-train`` hands ``cycle`` the wrapper of
``accelerator.prepare``, which keeps attribute writes to itself.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import sys
from pathlib import Path

from ... import config, process
from ...records import summary
from ...workers import start_method
from .. import flags
from . import layouts

log = logging.getLogger("swift_safe_media")

TRAIN_CONFIG = "lerobot.configs.train"
START_METHOD_FIELD = "dataloader_multiprocessing_context"
TRAIN_CONFIG_FILE = "train_config.json"

# True while ``cycle`` draws a batch: DataLoader workers started meanwhile are the
# training loader's, whatever wraps it (accelerate's DataLoaderShard and
# DataLoaderDispatcher start the inner loader's iterator lazily, on the first draw).
_drawing_training_batch = contextvars.ContextVar("swift_safe_media_drawing_training_batch", default=False)
_announced: set[str] = set()


def cycle_with_start_method(iterable):
    """LeRobot's ``cycle`` (how ``lerobot-train`` draws its batches): DataLoader workers
    started while it draws get the configured start method (:func:`worker_start_method`);
    the run summary goes to the log every ``SWIFT_SAFE_MEDIA_SUMMARY_STEPS`` batches
    (``--log_freq``) and at exit."""
    return _reporting(layouts.stock("cycle")(iterable))


def _reporting(batches):
    state = process.current()
    summary.report_at_exit(lambda: process.current().batches_drawn)  # lerobot-train ends by exiting, mid-cycle
    every = summary.summary_steps()
    while True:
        marker = _drawing_training_batch.set(True)
        try:
            batch = next(batches)
        except StopIteration:
            return
        finally:
            _drawing_training_batch.reset(marker)
        state.batches_drawn += 1
        yield batch
        if every and state.batches_drawn % every == 0:
            summary.report(step=state.batches_drawn)


def worker_start_method(loader) -> str | None:
    """The start method for ``loader`` (LeRobot 0.4 - 0.6.0's loaders, and any loader of a
    LeRobot dataset that names none), asked as it starts its workers; None leaves it."""
    if loader.multiprocessing_context is not None:
        return None  # named: by the user, or by lerobot-train's setting (worker_kwargs_with_start_method)
    if not (_drawing_training_batch.get() or _is_lerobot_dataset(loader.dataset)):
        return None
    if train_config_has_start_method():
        return None  # 0.6.1 on: no start method there is the user's own choice (the default is spawn)
    return _ours()


def worker_kwargs_with_start_method(cfg) -> dict:
    """``lerobot-train``'s ``_dataloader_worker_kwargs`` (0.6.1 on; its training and eval
    loaders): our start method in place of LeRobot's default, never of the user's choice."""
    kwargs = layouts.stock("_dataloader_worker_kwargs")(cfg)
    if kwargs.get("multiprocessing_context") is None or _named_by_user(cfg):
        return kwargs
    method = _ours()
    if method is not None:
        kwargs["multiprocessing_context"] = start_method.context_for(method)
    return kwargs


def _ours() -> str | None:
    method = config.mp_context()
    if method == "default":
        return None
    if method not in _announced:
        _announced.add(method)
        log.warning("swift_safe_media: DataLoader workers use the %r start method", method)
    return method


def _is_lerobot_dataset(dataset) -> bool:
    while type(dataset).__name__ == "Subset" and hasattr(dataset, "dataset"):
        dataset = dataset.dataset  # torch's Subset (0.6's eval loader with max_eval_samples)
    return type(dataset).__module__.startswith("lerobot.")


def train_config_has_start_method(train_config_class=None) -> bool:
    """True on LeRobot versions whose TrainPipelineConfig lets the user choose."""
    return _field_default(train_config_class) is not _MISSING


_MISSING = object()


def _field_default(train_config_class=None):
    if train_config_class is None:
        module = sys.modules.get(TRAIN_CONFIG)
        train_config_class = getattr(module, "TrainPipelineConfig", None)
    if train_config_class is None or not dataclasses.is_dataclass(train_config_class):
        return _MISSING
    return next((field.default for field in dataclasses.fields(train_config_class)
                 if field.name == START_METHOD_FIELD), _MISSING)


def _named_by_user(cfg, argv=None) -> bool:
    """Whether ``cfg``'s start method is the user's choice rather than LeRobot's default:
    another value, or the default named on the command line or in a config file the user
    wrote (a checkpoint's saved config, read by ``--resume``, records the default too)."""
    argv = sys.argv[1:] if argv is None else argv
    value = getattr(cfg, START_METHOD_FIELD, None)
    if value != _field_default(type(cfg)):
        return True
    if flags.argument(argv, f"--{START_METHOD_FIELD}") is not None:
        return True
    config_path = flags.argument(argv, "--config_path")
    if config_path is None or (flags.argument(argv, "--resume") or "").lower() in ("true", "1", "yes"):
        return False
    return START_METHOD_FIELD in _config_file(config_path)


def _config_file(path: str) -> dict:
    """The top level of a draccus config file (JSON or YAML; a folder: its train config)."""
    file = Path(path)
    if file.is_dir():
        file = file / TRAIN_CONFIG_FILE
    try:
        text = file.read_text()
    except OSError:
        return {}  # a Hub repo id, or unreadable: nothing the user wrote here
    try:
        loaded = json.loads(text)
    except ValueError:
        try:
            import yaml

            loaded = yaml.safe_load(text)
        except Exception:
            return {}
    return loaded if isinstance(loaded, dict) else {}
