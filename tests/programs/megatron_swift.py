"""Megatron-SWIFT's own pieces up to the model, protected: ``megatron sft``'s pipeline,
arguments, dataset, DataLoader builders and trainer events, on the CPU.

``python -m tests.programs.megatron_swift parse ARGV...`` parses ARGV with ms-swift's
``parse_args`` (what every Megatron-SWIFT pipeline calls) over ``MegatronSftArguments``,
``MegatronPretrainArguments`` and ``MegatronRLHFArguments`` (``--rlhf_type dpo``) in turn,
printing one JSON line each: the DataLoader arguments, whether protection is on, the
registry the environment names.

``python -m tests.programs.megatron_swift loaders ARGV...`` (with ``tests/megatron_shim.py``'s
folder on ``PYTHONPATH``) runs, as ``megatron sft ARGV`` does, ``MegatronSft(ARGV)``: ms-swift's
``parse_args`` over ``MegatronSftArguments`` (``--skip_megatron_init true``, Megatron-SWIFT's
own switch, stops it before CUDA's set-up), the dummy model on the meta device, the template
and the lazily encoded dataset. Then, with megatron-core's parallel state on one process
(gloo), the trainer's own methods: ``_get_data_collator``, ``_prepare_dataloader`` (the
map-style loader, ``_create_dataloader``) and ``build_streaming_dataloader`` each give a
DataLoader that is drawn to its end, and ``call_event`` is called as the training loop calls
it, ``on_log`` after each batch and ``on_train_end`` last. Prints one JSON line: the parsed
DataLoader arguments, each loader's start method and batch count, the environment's
registry setting.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import types

import torch


def start_method(loader) -> str | None:
    context = loader.multiprocessing_context
    return context.get_start_method() if context is not None else None


DATALOADER_ARGS = ("dataloader_num_workers", "dataloader_multiprocessing_context", "dataloader_persistent_workers",
                   "output_dir")


def parse(argv: list[str]) -> None:
    import swift_safe_media
    from swift.megatron.arguments import MegatronPretrainArguments, MegatronRLHFArguments, MegatronSftArguments
    from swift.utils import parse_args

    for args_class, extra in ((MegatronSftArguments, []), (MegatronPretrainArguments, []),
                              (MegatronRLHFArguments, ["--rlhf_type", "dpo"])):
        args, remaining = parse_args(args_class, argv + extra)
        print(json.dumps({"class": args_class.__name__, "remaining": remaining, "enabled": swift_safe_media.is_enabled(),
                          "quarantine": os.environ.get("SWIFT_SAFE_MEDIA_QUARANTINE"),
                          **{name: getattr(args, name) for name in DATALOADER_ARGS}}))


def loaders(argv: list[str]) -> None:
    with socket.socket() as probe:  # a free port for gloo's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron.core import mpu

    from swift.megatron.pipelines.train.sft import MegatronSft
    from swift.megatron.trainers.base import BaseMegatronTrainer
    from swift.megatron.trainers.utils import TrainerState, build_streaming_dataloader

    pipeline = MegatronSft(argv)
    args = pipeline.args
    torch.distributed.init_process_group("gloo", world_size=1, rank=0)
    mpu.initialize_model_parallel()
    train_dataset, _ = pipeline._prepare_dataset()

    trainer = types.SimpleNamespace(args=args, template=pipeline.template, state=TrainerState(), callbacks=[])
    trainer.data_collator = BaseMegatronTrainer._get_data_collator(trainer)
    trainer._create_dataloader = types.MethodType(BaseMegatronTrainer._create_dataloader, trainer)
    map_style, _ = BaseMegatronTrainer._prepare_dataloader(trainer, train_dataset, None)
    # What the trainer builds for --streaming true: a dispatcher over the DataLoader.
    streaming = build_streaming_dataloader(args, train_dataset, trainer.data_collator)
    loaders = {"map_style": (map_style, map_style), "streaming": (streaming, streaming.base_dataloader)}
    found = {"args": {name: getattr(args, name) for name in DATALOADER_ARGS},
        "quarantine": os.environ.get("SWIFT_SAFE_MEDIA_QUARANTINE"), "loaders": {}}
    for name, (drawn, loader) in loaders.items():
        batches = 0
        for batch in drawn:
            assert batch["input_ids"].shape[0] == args.micro_batch_size
            batches += 1
            trainer.state.iteration += 1
            BaseMegatronTrainer.call_event(trainer, "on_log", logs={})
        found["loaders"][name] = {"start_method": start_method(loader), "batches": batches,
                                  "workers": loader.num_workers}
    BaseMegatronTrainer.call_event(trainer, "on_train_end")
    found["steps"] = trainer.state.iteration
    print(json.dumps(found, default=str))


if __name__ == "__main__":
    {"parse": parse, "loaders": loaders}[sys.argv[1]](sys.argv[2:])
