"""An import shim for NVIDIA Transformer Engine, so that Megatron-SWIFT's modules import on
a machine without a GPU (CI's): ``mcore-bridge`` imports ``transformer_engine`` as it
loads, and TE's PyTorch extension (``transformer_engine_torch``) is published only as
source that builds with CUDA's compiler. Every name under ``transformer_engine`` resolves
to an empty class; nothing of it is ever called here: what the Megatron-SWIFT tests run
(argument parsing, the dataset, the DataLoader builders, the trainer's events) stops
short of building the model, the first step that needs a GPU.

``write(folder)`` makes ``folder`` a ``PYTHONPATH`` entry that installs the shim in every
interpreter started with it (a ``sitecustomize`` module), with the distribution's
metadata megatron-core reads (``transformer-engine`` 2.11.0, the newest megatron-core
0.16 accepts).
"""

from __future__ import annotations

import os

VERSION = "2.11.0"

SHIM = '''
import importlib.abc, importlib.machinery, sys, types


class _Names(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _empty_class(name)


def _empty_class(name):
    return _Names(name, (), {"__init__": lambda self, *args, **kwargs: None})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _empty_class(name)
        setattr(self, name, value)
        return value


class _Shim(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "transformer_engine" or fullname.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Shim())
'''


def write(folder: str) -> str:
    os.makedirs(os.path.join(folder, f"transformer_engine-{VERSION}.dist-info"), exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SHIM)
    with open(os.path.join(folder, f"transformer_engine-{VERSION}.dist-info", "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: transformer-engine\nVersion: {VERSION}\n")
    return folder
