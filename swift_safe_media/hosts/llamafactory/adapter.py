"""LLaMA-Factory adapter (0.9.x): bounded media reads, bad rows dropped or substituted,
the workers' start method, the run summary and the ``safe_media*`` settings.

- :mod:`.decode`: every media read of ``mm_plugin`` (images, videos, audios,
  the video metadata Qwen-VL plugins read for their token count) in the sandbox with
  the timeout, LLaMA-Factory's own code run there, so outputs are stock's bit for bit;
- :mod:`.rows`: a row whose media fail is dropped at preprocessing, a
  sample whose media fail at collation is replaced by another of its batch;
- :mod:`.workers`: the workers' start method (the warm forkserver) and the
  collator as a worker receives it (its model as a meta copy);
- :mod:`.map`: the preprocessing ``map`` processes from the warm forkserver;
- here: the protocol of :mod:`swift_safe_media.patching.host_adapters`, the settings and the summary
  callback.

Settings. ``llamafactory-cli train run.yaml`` parses its YAML (with ``key=value``
overrides, or a plain ``--key value`` command line) with ``HfArgumentParser``, which refuses
unknown keys. ``read_args`` (what reads them) is wrapped, whether or not protection is
on, to take out ``safe_media: true`` and every other ``safe_media_*`` key
(:data:`.flags.FLAGS`, without the dashes) and write them to the ``SWIFT_SAFE_MEDIA*``
environment; a multi-GPU run re-launches itself under torchrun with the same YAML, so every
rank reads them too. The quarantine registry defaults to
``<output_dir>/safe_media/quarantine.jsonl``, the summary goes next to it.
"""

from __future__ import annotations

import os
import sys

from ... import config, process
from ...engine import calls as engine
from ...records import summary
from ...patching.host_adapters import ModuleAdapter, env_state, installed_version, register
from .. import flags
from ...patching.moved_targets import DecodeFunctions
from ...patching.targets import Patcher, Patches, Target, original_of
from .decode import MM_PLUGIN, import_llamafactory_in_sandbox
from .map import DATASETS_MANAGER_MODULE, POOL_MODULE
from .workers import worker_start_method  # noqa: F401 (protocol)

HOST = "llamafactory"
DISTRIBUTION = "llamafactory"
# Tested with 0.9.5. 0.9.0 and 0.9.1 read media in BasePlugin and preprocess in data.processors
# (another layout): outside the range, they are named and left untouched.
SUPPORTED = ((0, 9, 2), (0, 10, 0))
PARSER = "llamafactory.hparams.parser"
FLAG_MODULES = (PARSER,)
COLLATOR = "llamafactory.data.collator"
TUNER = "llamafactory.train.tuner"
# What DataLoader workers need to unpickle LLaMA-Factory's collator (template, processor),
# and the preprocessing map's processes its converter and dataset processors (the loader
# imports both; 1.9 s in each map process otherwise): the warm forkserver imports it once,
# and the zygote forked from it has the plugins.
WORKER_PRELOAD = ("transformers", "datasets", COLLATOR, MM_PLUGIN, "llamafactory.data.loader")
RUN_FOLDER = "safe_media"

_DECODE = "swift_safe_media.hosts.llamafactory.decode"
_ROWS = "swift_safe_media.hosts.llamafactory.rows"
_PROCESSORS = (("supervised", "SupervisedDatasetProcessor"), ("supervised", "PackedSupervisedDatasetProcessor"),
               ("unsupervised", "UnsupervisedDatasetProcessor"), ("pairwise", "PairwiseDatasetProcessor"),
               ("feedback", "FeedbackDatasetProcessor"))
_SINCE_095 = "llamafactory>=0.9.5"  # read off each 0.9.x release's source; a row naming none: all of 0.9.2 on
TARGETS = (
    # Where each plugin class defines a media read of its own (the others inherit these).
    *(Target(MM_PLUGIN, f"{cls}.{method}", f"{_DECODE}:regularize_each", expected_in=since)
      for cls, method, since in (("MMPluginMixin", "_regularize_images", None),
                                 ("MMPluginMixin", "_regularize_videos", None),
                                 ("MMPluginMixin", "_regularize_audios", None),
                                 ("Qwen2VLPlugin", "_regularize_videos", None),
                                 ("Gemma4Plugin", "_regularize_videos", _SINCE_095))),
    Target(MM_PLUGIN, "Qwen2VLPlugin._get_qwen_video_stream_metadata", f"{_DECODE}:video_metadata_in_sandbox",
           expected_in=_SINCE_095),
    Target(MM_PLUGIN, "MiniCPMV4_6Plugin._get_mm_inputs", f"{_DECODE}:mm_inputs_in_sandbox", expected_in=_SINCE_095),
    *(Target(f"llamafactory.data.processor.{module}", f"{cls}.preprocess_dataset",
             f"{_ROWS}:preprocess_dropping_bad_rows") for module, cls in _PROCESSORS),
    *(Target(COLLATOR, f"{cls}.__call__", f"{_ROWS}:collate_or_substitute")
      for cls in ("MultiModalDataCollatorForSeq2Seq", "SFTDataCollatorWith4DAttentionMask",
                  "PairwiseDataCollatorWithPadding", "KTODataCollatorWithPadding")),
    # Workers started by the warm forkserver get the collator's model as a meta copy.
    Target(COLLATOR, "MultiModalDataCollatorForSeq2Seq.__getstate__",
           "swift_safe_media.hosts.llamafactory.workers:collator_state_for_workers", only_if_missing=True),
    Target(TUNER, "_training_function", "training_function_with_summary"),
    # The preprocessing map's processes start from the warm forkserver (.map). datasets calls
    # multiprocess's Pool (4.0-4.7 by the name copied into arrow_dataset, 4.8 on as mp.Pool); up
    # to 4.7 its progress queue's Manager is py_utils' copy of multiprocessing's, from 4.8 the pool's own.
    Target(POOL_MODULE, "Pool", "swift_safe_media.hosts.llamafactory.map:map_pool"),
    Target(DATASETS_MANAGER_MODULE, "Manager", "swift_safe_media.hosts.llamafactory.map:map_manager",
           expected_in="datasets<4.8"),
)

# mm_plugin's media reads: a plugin that defines one of its own (a name of this shape no row
# above covers) is named at start-up.
DECODE_FUNCTIONS = (DecodeFunctions(MM_PLUGIN, r"^_regularize_(images|videos|audios)$|^_get_\w*stream_metadata$"),)


def get_version() -> str | None:
    return installed_version(DISTRIBUTION)


def training_function_with_summary(*args, **kwargs) -> None:
    """LLaMA-Factory's ``_training_function(config)``: the run summary callback joins the
    run's, and the collator learns the training dataset (its stand-ins come from there)."""
    from transformers import TrainerCallback

    from ...records.trainer_callback import SummaryCallback
    from .rows import remember_rows

    class StandInRows(TrainerCallback):
        def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
            remember_rows(train_dataloader)

    run = kwargs["config"] if "config" in kwargs else args[0]
    callbacks = run.get("callbacks")
    if isinstance(callbacks, list):
        callbacks += [SummaryCallback(), StandInRows()]
    if process.rank() == 0:
        summary.report_at_exit(summary.step_noted)  # training that dies gets its summary too
    return original_of(sys.modules[TUNER]._training_function)(*args, **kwargs)


PATCHES = Patches(("llamafactory.", "datasets.", "multiprocess"), TARGETS, globals(), label="LLaMA-Factory",
                  decode_functions=DECODE_FUNCTIONS)
# LLaMA-Factory's own modules only: importing datasets (an ms-swift run, say) patches nothing;
# LLaMA-Factory imports datasets before the modules that trigger.
TRIGGER_MODULES = tuple(name for name in PATCHES.modules if name.startswith("llamafactory."))
is_patched, patched_sites = PATCHES.is_patched, PATCHES.sites


def patch() -> None:
    engine.set_up_sandboxes(import_llamafactory_in_sandbox)
    engine.import_before_fork(MM_PLUGIN)  # its reads run in a sandbox per call (engine.BY_NAME)
    PATCHES.patch()


def unpatch() -> None:
    PATCHES.unpatch()
    engine.forget_sandbox_setup(import_llamafactory_in_sandbox)


# -- settings -----------------------------------------------------------------------------------
_flag_patcher = Patcher(("llamafactory.",))


def command_line_asks_for_protection() -> bool:
    """``llamafactory-cli train run.yaml`` whose YAML (or a ``safe_media=true`` after it)
    turns protection on: seen as LLaMA-Factory begins importing."""
    return flags.config_file_asks_for_protection(sys.argv[1:])


def register_flags() -> None:
    """Wrap ``read_args`` (and its copies) so that the ``safe_media*`` keys never reach
    ``HfArgumentParser``, whether or not protection is on."""
    import sys

    stock = getattr(sys.modules[PARSER], "read_args")
    _flag_patcher.replace(PARSER, "read_args", lambda args=None: read_args_taking_flags(stock, args))


def read_args_taking_flags(stock, args=None):
    """``read_args``, with the ``safe_media*`` settings taken out and applied."""
    read = stock(args)
    if isinstance(read, dict):
        ours = {key: read.pop(key) for key in list(read) if _option(key) in flags.BY_OPTION}
        values, _ = flags.take_flags([f"{_option(key)}={value}" for key, value in ours.items()])
        output_dir, workers = read.get("output_dir"), read.get("dataloader_num_workers")
    elif isinstance(read, list):
        values, read = flags.take_flags(read)
        output_dir, workers = flags.argument(read, "--output_dir"), flags.argument(read, "--dataloader_num_workers")
    else:
        return read
    enabled = values.get(flags.ENABLED)
    if enabled is True or (enabled is None and env_state()):
        if output_dir and "quarantine" not in values and not config.is_set(config.QUARANTINE):
            values["quarantine"] = os.path.join(str(output_dir), RUN_FOLDER, "quarantine.jsonl")
        process.current().dataloader_workers_expected = str(workers or 0).strip() not in ("", "0")
        values[flags.ENABLED] = True  # again if on already: the stats folder follows the registry
    flags.apply(values, HOST)
    return read


def _option(key) -> str:
    return "--" + str(key).lstrip("-")


ADAPTER = register(ModuleAdapter(sys.modules[__name__]))  # the protocol of patching/host_adapters.py, filled in
