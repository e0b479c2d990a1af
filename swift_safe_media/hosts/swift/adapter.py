"""ms-swift adapter: safe loaders in ``swift.template`` and the Qwen utils, the
``--safe_media*`` flags, spawn-started DataLoader workers, the error budget and the
run summary.

The patch targets are data (``TARGETS``): each row names a host function and the
safe twin that replaces it, in the defining module and in every module that copied it
with ``from ..vision_utils import load_audio`` (``swift.template.base``,
``swift.template.templates.*``), or a host method and its stand-in. A ``MediaDecodeError`` propagates through the
template, so ms-swift's ``LazyLLMDataset`` takes another sample and its pre-tokenising
``map`` drops the row; one log line names the file, the reason and the elapsed time.

Methods patched: ``LazyLLMDataset.__getitem__`` counts each row it tries against the
error budget; the trainer's ``_get_callbacks`` adds the summary callback, and
Megatron-SWIFT's ``BaseMegatronTrainer.call_event`` reports the summary as it logs. Once
ms-swift (or Megatron-SWIFT) has resolved its output directory, the quarantine registry
defaults to ``<output_dir>/safe_media/quarantine.jsonl``.

DataLoader workers start by ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (``--dataloader_multiprocessing_context``
is added for ms-swift's and Megatron-SWIFT's argument classes), except those of a
template that reads its model while it encodes (:mod:`.templates`), which fork
from the trainer as stock ms-swift's do (:func:`worker_start_method`).
"""

from __future__ import annotations

import argparse
import contextvars
import copy
import dataclasses
import functools
import logging
import os
import sys

from ... import config, process
from ...records import summary
from ...records.budget import ErrorBudgetExceeded, process_budget
from ...errors import MediaDecodeError
from ...patching.host_adapters import ModuleAdapter, env_state, installed_version, register
from .. import flags
from . import inference as swift_inference
from ...patching.moved_targets import DecodeFunctions
from ...patching.targets import Patcher, Patches, Target

log = logging.getLogger("swift_safe_media")

HOST = "swift"
DISTRIBUTION = "ms-swift"
SUPPORTED = ((4, 0), (5, 0))
# What DataLoader workers need to unpickle LazyLLMDataset, the template and its processor:
# the warm forkserver imports it once (see warm_start).
WORKER_PRELOAD = ("transformers", "datasets", "swift.template", "swift.dataset.utils")
LOADERS_HELD = False  # they get --dataloader_multiprocessing_context (parse_args): CPython's own context

_SWIFT_LOADERS = ("load_audio", "load_video_internvl", "load_video_cogvlm2", "load_video_llava",
                  "load_video_minicpmv_mplug_owl3", "load_video_valley", "load_video_ovis2", "load_video_ovis2_5",
                  "load_video_hf", "load_vllm_video")

TARGETS = (
    # Where a row names no release, every supported ms-swift has it (read off each 4.x release's source).
    *(Target("swift.template.vision_utils", name, f"swift_safe_media.decoders.swift:{name}",
             expected_in="ms-swift>=4.4" if name == "load_vllm_video" else None)
      for name in _SWIFT_LOADERS),
    # ms-swift's Qwen2.5-VL / Qwen3-VL templates decode video through qwen_vl_utils, the
    # Omni templates through qwen_omni_utils (both import them inside replace_tag).
    Target("qwen_vl_utils.vision_process", "fetch_video", "swift_safe_media.decoders.qwen:fetch_video"),
    Target("qwen_omni_utils.v2_5.vision_process", "fetch_video", "swift_safe_media.decoders.qwen:fetch_video"),
    Target("qwen_omni_utils.v2_5.audio_process", "process_audio_info",
           "swift_safe_media.decoders.qwen:process_audio_info"),
    Target("swift.dataset.utils", "LazyLLMDataset.__getitem__", "getitem_within_budget"),
    Target("swift.trainers.mixin", "SwiftMixin._get_callbacks", "callbacks_with_summary"),
    # Megatron-SWIFT's trainers have callbacks of their own (megatron sft / pt / rlhf).
    Target("swift.megatron.trainers.base", "BaseMegatronTrainer.call_event", "megatron_event_with_summary"),
    # ms-swift 4.6 pickles templates without the model; 4.0-4.5 ship the whole model
    # (template.model is set for Qwen2-VL/Omni, Ovis, LLaVA, ...) to every spawned worker.
    Target("swift.template.base", "Template.__getstate__", "template_state_without_model", only_if_missing=True),
    # A template whose decode protection cannot bound gets one warning as it is built (issue 32).
    Target("swift.template.base", "Template.__init__", "swift_safe_media.hosts.swift.coverage:template_built"),
    # swift infer, deploy and GRPO rollouts: a row or a request whose media fail fails alone.
    *swift_inference.TARGETS,
)
# ms-swift's loaders and the Qwen utils' video readers: a new one (a name of this shape that no row
# above covers, nor is one of the backends fetch_video calls) is named at start-up.
_QWEN_BACKENDS = ("_read_video_torchvision", "_read_video_decord", "_read_video_torchcodec")
DECODE_FUNCTIONS = (
    DecodeFunctions("swift.template.vision_utils", r"^load_(video|audio)"),
    *(DecodeFunctions(module, r"^(fetch_video|_read_video_)", inner=_QWEN_BACKENDS)
      for module in ("qwen_vl_utils.vision_process", "qwen_omni_utils.v2_5.vision_process")),
)
# Where copies of the host functions may live ("swift." and not "swift": not us).
SCOPE = ("swift.", "qwen_vl_utils", "qwen_omni_utils")
FLAG_MODULES = ("swift.utils.utils",)

# The run's folder for the registry, the stats and the summary, under ms-swift's output_dir.
RUN_FOLDER = "safe_media"


def get_version() -> str | None:
    return installed_version(DISTRIBUTION)


def _logging_failures(twin):
    return functools.wraps(twin)(functools.partial(_call_logging_failures, twin))


PATCHES = Patches(SCOPE, TARGETS, globals(), wrap_functions=_logging_failures, label="ms-swift",
                  decode_functions=DECODE_FUNCTIONS)
TRIGGER_MODULES = PATCHES.modules
patch, unpatch, is_patched, patched_sites = PATCHES.patch, PATCHES.unpatch, PATCHES.is_patched, PATCHES.sites
_flag_patcher = Patcher(("swift.",))


@dataclasses.dataclass
class RowOutcome:
    """What the loaders did while one row was encoded: the error budget's evidence."""
    decoded: int = 0
    failed: int = 0
    last_failure: str = ""


# The row being encoded in this context (set by _encode_within_budget), if any.
current_row: contextvars.ContextVar[RowOutcome | None] = contextvars.ContextVar("swift_safe_media_row",
                                                                               default=None)


def _call_logging_failures(twin, *args, **kwargs):
    row = current_row.get()
    try:
        result = twin(*args, **kwargs)
    except MediaDecodeError as exc:
        if row is not None:
            row.failed += 1
            row.last_failure = f"{exc.path}: {exc.reason} ({type(exc).__name__})"
        # ms-swift's Template.encode retries a failed sample twice at once: one line per sample.
        state = process.current()
        if swift_inference.first_of_its_row(exc) and state.last_logged_failure != (exc.path, exc.reason):
            state.last_logged_failure = (exc.path, exc.reason)
            after = "" if exc.elapsed is None else f", after {exc.elapsed:.2f} s"
            _host_logger().warning(f"swift_safe_media: skipped {exc.path}: {exc.reason} "
                                   f"({type(exc).__name__}{after}); {swift_inference.consequence()}")
        raise
    if row is not None:
        row.decoded += 1
    return result


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
    outcome = RowOutcome()
    token = current_row.set(outcome)
    try:
        encoded = encode(row, *args, **kwargs)
    except Exception:
        if outcome.failed:
            try:
                process_budget().failure(outcome.last_failure)
            except ErrorBudgetExceeded as exc:
                raise _BudgetSpent(exc) from None
        raise
    finally:
        current_row.reset(token)
    if outcome.decoded:
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


# --- templates that read their model in the workers -------------------------------------

@dataclasses.dataclass
class RunState:
    """What this process's ms-swift run decided for the user (parse_args)."""
    # The start method parse_args gave ms-swift's DataLoaders (the user named none), if any.
    start_method_chosen_for_user: str | None = None
    warned: set = dataclasses.field(default_factory=set)  # template classes named in a warning


RUN = RunState()


def worker_start_method(loader) -> str | None:
    """``fork`` for a DataLoader whose template reads its model while it encodes (found by
    :mod:`.templates`), when the start method is the one protection chose: workers
    started by spawn or a forkserver get the template without its model
    (``Template.__getstate__``), so they fork from the trainer as stock ms-swift's do.
    Their decodes still run in sandboxes forked from the clean zygote. A start method the
    user named is kept (one warning)."""
    from ...workers import spawn_guard
    from . import templates as swift_templates

    method = spawn_guard.start_method(loader)
    if method not in spawn_guard.RERUN_BY_CHILDREN:
        return None
    for template in swift_templates.templates_of(loader):
        reads = swift_templates.needs_model_in_workers(template)
        if not reads:
            continue
        ours = method == RUN.start_method_chosen_for_user and not config.is_set(config.MP_CONTEXT)
        name = type(template).__name__
        if name not in RUN.warned:
            RUN.warned.add(name)
            if ours:
                log.warning(f"swift_safe_media: ms-swift's {name} reads the model while it encodes "
                            f"({', '.join(reads)}), and DataLoader workers started by {method} get the template "
                            f"without it; its DataLoader workers fork from the trainer, as stock ms-swift's "
                            f"do. Every decode still runs in a sandbox of the clean zygote.")
            else:
                log.warning(f"swift_safe_media: ms-swift's {name} reads the model while it encodes "
                            f"({', '.join(reads)}), and DataLoader workers started by {method}, the start "
                            f"method named for this run, get the template without it (model=None)")
        return "fork" if ours else None
    return None


# --- run summary ---------------------------------------------------------------------

def callbacks_with_summary(stock_get_callbacks, trainer, args):
    from ...records.trainer_callback import SummaryCallback

    return stock_get_callbacks(trainer, args) + [SummaryCallback()]


def megatron_event_with_summary(stock_call_event, trainer, event, **kwargs):
    """``BaseMegatronTrainer.call_event``: after the callbacks, every rank notes the
    iteration it reached; rank 0 logs the summary at each logged step (``--log_interval``)
    and at the end of training, and writes it next to the registry."""
    result = stock_call_event(trainer, event, **kwargs)
    if event in ("on_log", "on_train_end") and trainer.state is not None:
        step = trainer.state.iteration
        summary.note_step(step)
        if process.rank() == 0:
            summary.report(step=step, final=event == "on_train_end")
    return result


# --- flags ---------------------------------------------------------------------------

FLAGS = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
flags.add_arguments(FLAGS.add_argument_group("swift-safe-media (bounded, isolated media decoding)"))
_MP_FLAG = "--dataloader_multiprocessing_context"
_PERSISTENT_FLAG = "--dataloader_persistent_workers"


def register_flags() -> None:
    """Teach ms-swift's ``parse_args`` (every pipeline: sft, pt, rlhf, infer, export, ...) the flags."""
    module = sys.modules["swift.utils.utils"]
    original = getattr(module, "parse_args")
    _flag_patcher.replace("swift.utils.utils", "parse_args", functools.partial(parse_args, original))


def command_line_asks_for_protection() -> bool:
    """``swift sft ... --safe_media true``: lets the decoders be checked in the ``swift``
    launcher, seconds after the command, rather than once the training process has
    imported all of ms-swift (a minute on a busy machine). A config file's
    ``safe_media: true`` is read later, by the training process, and checked there."""
    try:
        ours, _ = FLAGS.parse_known_args(sys.argv[1:])
    except (SystemExit, Exception):  # a malformed flag is for ms-swift's parse_args to report
        return False
    return ours.safe_media is True


def is_launcher() -> bool:
    """``swift sft ...`` / ``megatron sft ...``: the console script runs the command's
    script (``swift/cli/sft.py``) in a child process (or torchrun's), where the run is."""
    return os.path.basename(sys.argv[0]) in ("swift", "megatron") and len(sys.argv) > 1


def parse_args(original, class_type, argv=None):
    """Take our flags out of ``argv``, apply them, hand the rest to ms-swift's parser."""
    ours, rest = FLAGS.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    apply_flags(ours)
    mp_context = config.mp_context()
    if (env_state() and mp_context != "default" and _has_field(class_type, "dataloader_multiprocessing_context")
            and flags.argument(rest, _MP_FLAG) is None):
        rest += [_MP_FLAG, mp_context]
        RUN.start_method_chosen_for_user = mp_context
    if (env_state() and _has_field(class_type, "dataloader_persistent_workers")
            and flags.argument(rest, _PERSISTENT_FLAG) is None and flags.argument(rest, "--dataloader_num_workers") != "0"):
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


def apply_flags(parsed: argparse.Namespace) -> None:
    """Flag > environment > default: settings given are written to the environment."""
    flags.apply({flag.key: getattr(parsed, flag.option.lstrip("-")) for flag in flags.FLAGS}, HOST)


def protect_run(args) -> None:
    """Turn protection on in this process with the run's defaults, once ms-swift has
    parsed its arguments: a training run's registry (and, next to it, the stats and the
    summary) goes under its output_dir. That is the final one, with the ``v<N>-<time>``
    folder ms-swift adds and broadcasts to every rank, and it is in the environment
    before any DataLoader worker starts."""
    import swift_safe_media

    training = getattr(args, "training_args", None)
    # ms-swift's own trainers read transformers' TrainingArguments; Megatron-SWIFT's
    # training arguments are all in one class (the one with DataLoader workers).
    trains = training if training is not None else args if hasattr(args, "dataloader_num_workers") else None
    output_dir = getattr(trains, "output_dir", None)
    # Inference and export have no DataLoader workers: no warm forkserver for them.
    process.current().dataloader_workers_expected = bool(getattr(training or args, "dataloader_num_workers", 0))
    if swift_inference.choose_mode(args) == "deploy":
        from . import url_policy

        url_policy.allowed()  # a malformed SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS stops the server here, named
    folder = os.path.join(output_dir, RUN_FOLDER) if output_dir else swift_inference.run_folder(args)
    registry = None
    if folder and not config.is_set(config.QUARANTINE):
        registry = os.path.join(folder, "quarantine.jsonl")
    swift_safe_media.enable(hosts=[HOST], quarantine=registry)
    if process.rank() == 0:
        summary.report_at_exit(summary.step_noted)  # training that dies gets its summary too


def _has_field(class_type, name: str) -> bool:
    return dataclasses.is_dataclass(class_type) and any(field.name == name for field in dataclasses.fields(class_type))


ADAPTER = register(ModuleAdapter(sys.modules[__name__]))  # the protocol of patching/host_adapters.py, filled in
