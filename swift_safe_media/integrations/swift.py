"""ms-swift adapter: safe loaders in ``swift.template`` and the Qwen utils, the
``--safe_media*`` flags, spawn-started DataLoader workers, the error budget and the
run summary.

The patch targets are data (``PATCH_TABLE``): each row names a host function and the
safe twin that replaces it, in the defining module and in every module that copied it
with ``from ..vision_utils import load_audio`` (``swift.template.base``,
``swift.template.templates.*``). A ``MediaDecodeError`` propagates through the
template, so ms-swift's ``LazyLLMDataset`` takes another sample and its pre-tokenising
``map`` drops the row; one log line names the file, the reason and the elapsed time.

``METHOD_TABLE`` patches two methods: ``LazyLLMDataset.__getitem__`` counts each row it
tries against the error budget, and the trainer's ``_get_callbacks`` adds the summary
callback. Once ms-swift has resolved its output directory, the quarantine registry
defaults to ``<output_dir>/safe_media/quarantine.jsonl``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import logging
import os
import sys

from .. import config, summary
from ..budget import ErrorBudgetExceeded, process_budget
from ..errors import MediaDecodeError
from . import env_state, installed_version
from ._patching import MethodPatcher, Patcher

log = logging.getLogger("swift_safe_media")

HOST = "swift"
DISTRIBUTION = "ms-swift"
SUPPORTED = ((4, 0), (5, 0))

_SWIFT_LOADERS = ("load_audio", "load_video_internvl", "load_video_cogvlm2", "load_video_llava",
                  "load_video_minicpmv_mplug_owl3", "load_video_valley", "load_video_ovis2", "load_video_ovis2_5",
                  "load_video_hf", "load_vllm_video")

# (host module, function) -> (module of the safe twin, its name)
PATCH_TABLE = {
    **{("swift.template.vision_utils", name): ("swift_safe_media.decoders.swift", name) for name in _SWIFT_LOADERS},
    # ms-swift's Qwen2.5-VL / Qwen3-VL templates decode video through qwen_vl_utils, the
    # Omni templates through qwen_omni_utils (both import them inside replace_tag).
    ("qwen_vl_utils.vision_process", "fetch_video"): ("swift_safe_media.decoders.qwen", "fetch_video"),
    ("qwen_omni_utils.v2_5.vision_process", "fetch_video"): ("swift_safe_media.decoders.qwen", "fetch_video"),
    ("qwen_omni_utils.v2_5.audio_process", "process_audio_info"):
        ("swift_safe_media.decoders.qwen", "process_audio_info"),
}
# (host module, class, method) -> the stand-in here, called as stand_in(original, self, ...)
METHOD_TABLE = {
    ("swift.dataset.utils", "LazyLLMDataset", "__getitem__"): "getitem_within_budget",
    ("swift.trainers.mixin", "SwiftMixin", "_get_callbacks"): "callbacks_with_summary",
}
# (host module, class, method) -> the function here, added where the class lacks it
ADDED_METHODS = {
    # ms-swift 4.6 pickles templates without the model; 4.0-4.5 ship the whole model
    # (template.model is set for Qwen2-VL/Omni, Ovis, LLaVA, ...) to every spawned worker.
    ("swift.template.base", "Template", "__getstate__"): "template_state_without_model",
}
TRIGGER_MODULES = tuple(dict.fromkeys([module for module, _ in PATCH_TABLE]
                                      + [module for module, _, _ in METHOD_TABLE]
                                      + [module for module, _, _ in ADDED_METHODS]))
# Where copies of the host functions may live ("swift." and not "swift": not us).
SCOPE = ("swift.", "qwen_vl_utils", "qwen_omni_utils")
FLAG_MODULES = ("swift.utils.utils",)

# The run's folder for the registry, the stats and the summary, under ms-swift's output_dir.
RUN_FOLDER = "safe_media"

_patcher = Patcher(SCOPE)
_method_patcher = MethodPatcher()
_flag_patcher = Patcher(("swift.",))


def get_version() -> str | None:
    return installed_version(DISTRIBUTION)


def patch() -> None:
    for (module_name, name), (twin_module, twin_name) in PATCH_TABLE.items():
        # Older 4.x lack some loaders (4.2.2 has no load_vllm_video).
        if hasattr(sys.modules.get(module_name), name):
            twin = getattr(importlib.import_module(twin_module), twin_name)
            _patcher.replace(module_name, name, _logging_failures(twin))
    for (module_name, class_name, name), stand_in in METHOD_TABLE.items():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None:
            _method_patcher.replace(cls, name, globals()[stand_in])
    for (module_name, class_name, name), function in ADDED_METHODS.items():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None:
            _method_patcher.add(cls, name, globals()[function])


def unpatch() -> None:
    _patcher.restore()
    _method_patcher.restore()


def is_patched() -> bool:
    return bool(_patcher) or bool(_method_patcher)


def patched_sites() -> list[tuple[str, str]]:
    """(module, attribute) pairs that now call a safe twin."""
    return _patcher.sites()


_last_logged = None
# Loader calls in this process, for the error budget to tell which rows had media.
_decodes = {"ok": 0, "failed": 0}
_last_failure = ""


def _logging_failures(twin):
    @functools.wraps(twin)
    def call(*args, **kwargs):
        global _last_logged, _last_failure
        try:
            result = twin(*args, **kwargs)
        except MediaDecodeError as exc:
            _decodes["failed"] += 1
            _last_failure = f"{exc.path}: {exc.reason} ({type(exc).__name__})"
            # ms-swift's Template.encode retries a failed sample twice at once: one line per sample.
            if _last_logged != (exc.path, exc.reason):
                _last_logged = (exc.path, exc.reason)
                after = "" if exc.elapsed is None else f", after {exc.elapsed:.2f} s"
                _host_logger().warning(f"swift_safe_media: skipped {exc.path}: {exc.reason} "
                                       f"({type(exc).__name__}{after}); ms-swift takes another sample")
            raise
        _decodes["ok"] += 1
        return result
    return call


def _host_logger():
    # ms-swift's own logger, in ms-swift's format, where it passes warnings: on local
    # ranks other than 0 (and their DataLoader workers) it passes only errors.
    try:
        from swift.utils import get_logger
        logger = get_logger()
        if logger.isEnabledFor(logging.WARNING):
            return logger
    except Exception:
        pass
    return log


# --- error budget --------------------------------------------------------------------
# A sample is one row LazyLLMDataset tries to encode (ms-swift's own retries of it
# included): it failed if a loader raised MediaDecodeError while it was encoded, it
# succeeded if it was encoded and a loader decoded media for it. Rows without media do
# not count. Per process, like the DataLoader workers that encode the rows.

class _BudgetSpent(BaseException):
    """Carries ErrorBudgetExceeded past LazyLLMDataset's ``except Exception`` resample loop."""




def getitem_within_budget(stock_getitem, dataset, idx):
    """``LazyLLMDataset.__getitem__`` with each row it tries counted against the error budget;
    a spent budget raises ErrorBudgetExceeded to the DataLoader (and on to the trainer)."""
    encode = dataset.encode_func
    dataset.encode_func = functools.partial(_encode_within_budget, encode)
    try:
        return stock_getitem(dataset, idx)
    except _BudgetSpent as spent:
        raise spent.args[0] from None
    finally:
        dataset.encode_func = encode


def _encode_within_budget(encode, row, *args, **kwargs):
    ok, failed = _decodes["ok"], _decodes["failed"]
    try:
        encoded = encode(row, *args, **kwargs)
    except Exception:
        if _decodes["failed"] > failed:
            try:
                process_budget().failure(_last_failure)
            except ErrorBudgetExceeded as exc:
                raise _BudgetSpent(exc) from None
        raise
    if _decodes["ok"] > ok:
        process_budget().success()
    return encoded


# --- what a spawned worker receives ----------------------------------------------------

_TEMPLATE_STATE_DROPPED = {"model": None, "dummy_model": None, "_handles": [], "_deepspeed_initialize": None}


def template_state_without_model(template) -> dict:
    """``Template.__getstate__`` as ms-swift 4.6 has it, for what is pickled to a spawned
    or forkserver worker: the template without the model (its encode falls back to the
    template's dummy model, as on 4.6). ``copy(template)`` keeps the model, as before."""
    from multiprocessing.context import get_spawning_popen

    state = template.__dict__.copy()
    if get_spawning_popen() is not None:
        state.update({name: copy.copy(empty) for name, empty in _TEMPLATE_STATE_DROPPED.items() if name in state})
    return state


# --- run summary ---------------------------------------------------------------------

def callbacks_with_summary(stock_get_callbacks, trainer, args):
    from ..trainer_callback import SummaryCallback

    return stock_get_callbacks(trainer, args) + [SummaryCallback()]


# --- flags ---------------------------------------------------------------------------

def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _registry(text: str) -> str:
    return "" if text.strip().lower() in ("", "none", "off", "false") else text


FLAGS = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
_GROUP = FLAGS.add_argument_group("swift-safe-media (bounded, isolated media decoding)")
_GROUP.add_argument("--safe_media", type=_bool, default=None, metavar="{true,false}",
                    help="decode media in a sandbox with a hard timeout; skip and log bad samples "
                         "(default: false, or SWIFT_SAFE_MEDIA)")
_GROUP.add_argument("--safe_media_timeout", type=float, default=None, metavar="SECONDS",
                    help=f"seconds one decode may run (default: {config.DEFAULT_TIMEOUT_S:g}, "
                         f"or {config.TIMEOUT})")
_GROUP.add_argument("--safe_media_mp_context", choices=config.MP_CONTEXTS, default=None,
                    help="start method of DataLoader workers; 'default' leaves ms-swift's "
                         f"(default: spawn, or {config.MP_CONTEXT})")
_GROUP.add_argument("--safe_media_max_memory_mb", type=int, default=None, metavar="MB",
                    help=f"address space one decode may add; 0: no cap (default: RAM/4, or {config.MAX_MEMORY_MB})")
_GROUP.add_argument("--safe_media_quarantine", type=_registry, default=None, metavar="PATH",
                    help="JSON Lines registry of files that failed, refused at once afterwards; 'none': off "
                         f"(default: <output_dir>/{RUN_FOLDER}/quarantine.jsonl, or {config.QUARANTINE})")
_GROUP.add_argument("--safe_media_stall_timeout", type=float, default=None, metavar="SECONDS",
                    help="seconds without a batch before every process's stacks are logged; 0: off "
                         f"(default: 0, or {config.STALL_TIMEOUT})")
_GROUP.add_argument("--safe_media_stall_action", choices=("log", "abort"), default=None,
                    help=f"after the stacks, abort exits with code 75 (default: log, or {config.STALL_ACTION})")

_MP_FLAG = "--dataloader_multiprocessing_context"
_PERSISTENT_FLAG = "--dataloader_persistent_workers"


def _given(argv: list[str], flag: str) -> bool:
    return any(arg.split("=")[0] == flag for arg in argv)


def _argument(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` on the command line (``--flag value`` or ``--flag=value``)."""
    for position, arg in enumerate(argv):
        name, has_value, value = arg.partition("=")
        if name == flag:
            return value if has_value else (argv[position + 1] if position + 1 < len(argv) else None)
    return None


def register_flags() -> None:
    """Teach ms-swift's ``parse_args`` (every pipeline: sft, pt, rlhf, infer, export, ...) the flags."""
    module = sys.modules["swift.utils.utils"]
    original = getattr(module, "parse_args")
    _flag_patcher.replace("swift.utils.utils", "parse_args", functools.partial(parse_args, original))


def parse_args(original, class_type, argv=None):
    """Take our flags out of ``argv``, apply them, hand the rest to ms-swift's parser."""
    ours, rest = FLAGS.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    apply_flags(ours)
    mp_context = config.mp_context()
    if (env_state() and mp_context != "default" and _has_field(class_type, "dataloader_multiprocessing_context")
            and not _given(rest, _MP_FLAG)):
        rest += [_MP_FLAG, mp_context]
    if (env_state() and _has_field(class_type, "dataloader_persistent_workers")
            and not _given(rest, _PERSISTENT_FLAG) and _argument(rest, "--dataloader_num_workers") != "0"):
        # Workers (each with its zygote and sandbox) start once per run, not at every
        # epoch and evaluation. ms-swift 4.6 defaults to this; 4.0-4.5 do not.
        rest += [_PERSISTENT_FLAG, "true"]
    try:
        parsed = original(class_type, rest)
    except SystemExit:
        if any(arg in ("-h", "--help") for arg in rest):
            print("\n" + FLAGS.format_help().split("\n", 2)[-1].strip("\n"))
        raise
    if env_state():
        protect_run(parsed[0])
    return parsed


def apply_flags(flags: argparse.Namespace) -> None:
    """Flag > environment > default: settings given are written to the environment."""
    import swift_safe_media

    config.write(timeout=flags.safe_media_timeout, max_memory_mb=flags.safe_media_max_memory_mb,
                 mp_context=flags.safe_media_mp_context, quarantine=flags.safe_media_quarantine,
                 stall_timeout=flags.safe_media_stall_timeout, stall_action=flags.safe_media_stall_action)
    if flags.safe_media is True:
        swift_safe_media.enable(hosts=[HOST])
    elif flags.safe_media is False:
        swift_safe_media.disable()


def protect_run(args) -> None:
    """Turn protection on in this process with the run's defaults, once ms-swift has
    parsed its arguments: a training run's registry (and, next to it, the stats and the
    summary) goes under its output_dir. That is the final one, with the ``v<N>-<time>``
    folder ms-swift adds and broadcasts to every rank, and it is in the environment
    before any DataLoader worker starts."""
    import swift_safe_media

    output_dir = getattr(getattr(args, "training_args", None), "output_dir", None)
    registry = None
    if output_dir and config.QUARANTINE not in os.environ:
        registry = os.path.join(output_dir, RUN_FOLDER, "quarantine.jsonl")
    swift_safe_media.enable(hosts=[HOST], quarantine=registry)
    if int(os.environ.get("RANK", "0")) == 0:
        summary.report_at_exit(summary.step_noted)  # training that dies gets its summary too


def _has_field(class_type, name: str) -> bool:
    import dataclasses
    return dataclasses.is_dataclass(class_type) and any(field.name == name for field in dataclasses.fields(class_type))
