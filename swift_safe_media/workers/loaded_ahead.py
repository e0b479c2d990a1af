"""What transformers' ``from_pretrained`` loads, held ahead by holding servers that a loader's own
holding server is then forked from (the loader's: :mod:`.hold_ahead`, :mod:`.held_arguments`).

A loader's holding server starts as the loader is made, and a trainer starts the loader's
workers tens of ms later. LLaMA-Factory's first batch waited for its server to unpickle the
collator: about 0.1 s to parse a Hugging Face fast tokenizer (the Rust ``tokenizers.Tokenizer``
builds its vocabulary and merges from JSON), and 0.09 s to import the model family's modules its
processor's classes live in. Both are loaded seconds before, by ``from_pretrained`` (the rows of
:data:`TARGETS`, patched while protection is on). So, as a load returns, each step below starts
a holding server of its own, forked from the one before it (from the warm forkserver for the
first), which does its part while the trainer goes on; the loader's server is forked from the
newest (:func:`newest`) and finds it all done:

- **the first fast tokenizer loaded** (LLaMA-Factory's own; the processor's own tokenizer it
  loads next is then replaced by it): its Rust tokenizer, pickled once in the trainer, unpickled
  by its server. One a process, kept alive by the trainer from then on;
- **the model families' modules** (under ``transformers.models``: those an outermost load
  imported, and those of the families of the loaded object's classes: :func:`modules_of`),
  imported by its server, as a worker would on unpickling the classes, but with thread pools
  of one thread, as the warm forkserver imports.

When a loader's dataset and ``collate_fn`` are pickled for the loader's server
(:func:`references`, read by :func:`.held_arguments.fingerprint`), that same tokenizer object,
where its state is still the state handed (its pickled state compared as bytes: a reduction the
pickle makes anyway), is written as a reference (:func:`.held_arguments.held_part`) that carries
the tokenizer's bytes. Pickled in full, as before: a tokenizer changed since (tokens added, its
padding set), another object with the same state, a tokenizer whose server said it cannot hold
it. A server of these that is gone before it forks the next: the next starts from the warm
forkserver and unpickles the bytes the reference carries (what unpickling the tokenizer in full
gives) and imports as needed.

Not held where a loader's objects would not be (:func:`may_hold_here`: protection not asked
for in the environment, a warm forkserver this process did not start, a DataLoader worker),
outside the main process, beyond :data:`MAX_SERVERS`, under a host that hands its loaders a
context of their own (ms-swift, LeRobot: their adapters' ``LOADERS_HELD``; no loader's server
would fork from these), or with ``SWIFT_SAFE_MEDIA_LOADS_AHEAD=0``.
Every step fails open.
"""

from __future__ import annotations

import contextlib
import copyreg
import importlib
import io
import logging
import multiprocessing
import pickle
import sys
from dataclasses import dataclass

from .. import config, process
from ..patching import import_hooks
from ..patching.targets import Patches, Target
from . import held_arguments, reduced_once
from .forkserver_launch import _CONTEXT, warm_context

log = logging.getLogger("swift_safe_media")

_HERE = "swift_safe_media.workers.loaded_ahead:from_pretrained_holding_ahead"
TARGETS = (
    # The bases every tokenizer, processor, model, image processor and feature extractor class of
    # transformers 4.x and 5.x inherits its load from (the Auto classes call them).
    Target("transformers.tokenization_utils_base", "PreTrainedTokenizerBase.from_pretrained", _HERE),
    Target("transformers.processing_utils", "ProcessorMixin.from_pretrained", _HERE),
    Target("transformers.modeling_utils", "PreTrainedModel.from_pretrained", _HERE),
    Target("transformers.image_processing_base", "ImageProcessingMixin.from_pretrained", _HERE),
    Target("transformers.feature_extraction_utils", "FeatureExtractionMixin.from_pretrained", _HERE),
    # These Auto classes build their object from its config, not by the class's own load.
    Target("transformers.models.auto.image_processing_auto", "AutoImageProcessor.from_pretrained", _HERE),
    Target("transformers.models.auto.feature_extraction_auto", "AutoFeatureExtractor.from_pretrained", _HERE),
    Target("transformers.models.auto.video_processing_auto", "AutoVideoProcessor.from_pretrained", _HERE,
           expected_in="transformers>=4.52"),
)
PATCHES = Patches(("transformers",), TARGETS, {}, label="transformers' loading")
MODULES_HELD = "transformers.models."  # a model family's own modules: what its objects pickle name
MAX_SERVERS = 6  # a process loading model after model holds its first loads only
MAX_TOKENIZER_BYTES = 64 << 20  # the trainer keeps the bytes (references carry them)


@dataclass
class HeldTokenizer:
    """The trainer's record of the tokenizer handed ahead: its server (``unit``: the Rust
    tokenizer alone) and the pickled state the server unpickled."""

    server: held_arguments.HoldingServer
    state: object


def install() -> None:
    """Hold what transformers loads from now (as each of its loading modules is imported)."""
    state = process.current()
    if not state.loads_held_ahead:
        state.loads_held_ahead = True
        for module in PATCHES.modules:
            import_hooks.when_imported(module, _apply)


def uninstall() -> None:
    process.current().loads_held_ahead = False  # a module imported later leaves its row stock
    PATCHES.unpatch()


def _apply(_module) -> None:
    if process.current().loads_held_ahead and config.get(config.LOADS_AHEAD):
        PATCHES.patch()


def may_hold_here() -> bool:
    """Whether this process hands objects to holding servers: protection is asked for in the
    environment, this process started the warm forkserver (its launch read), it is no
    DataLoader worker, and the switch is on."""
    state = process.current()
    if (not config.get(config.WORKER_ARGUMENTS_AHEAD) or not config.enabled_by_environment() or state.in_forkserver
            or state.forkserver_environment is None or warm_context() is not _CONTEXT):
        return False
    worker_info = sys.modules.get("torch.utils.data._utils.worker")
    return worker_info is None or worker_info.get_worker_info() is None


def from_pretrained_holding_ahead(stock_from_pretrained, cls, *args, **kwargs):
    """transformers' ``from_pretrained``, then what it loaded handed ahead: the first fast
    tokenizer, and (by the outermost load) the model family's modules it imported."""
    state = process.current()
    before = set(sys.modules) if state.loads_underway == 0 else None
    state.loads_underway += 1
    try:
        loaded = stock_from_pretrained(*args, **kwargs)
    finally:
        state.loads_underway -= 1
    try:
        if _may_start_one():
            hold_tokenizer(loaded)
        if before is not None and _may_start_one():
            hold_modules(modules_of(loaded, sys.modules.keys() - before))
    except Exception:  # fail open: a loader's server unpickles them, as before
        log.debug("swift_safe_media: what from_pretrained loaded was not held ahead", exc_info=True)
    return loaded


def _may_start_one() -> bool:
    from ..patching import host_adapters

    return (config.get(config.LOADS_AHEAD) and len(process.current().loaded_ahead) < MAX_SERVERS
            and multiprocessing.current_process().name == "MainProcess" and may_hold_here()
            and host_adapters.loaders_may_be_held())


def _start(unit: tuple, data: bytes) -> held_arguments.HoldingServer:
    """A holding server for ``unit``, forked from the newest of this process's."""
    server = held_arguments.HoldingServer(unit, data, warm_context(), None, newest())
    process.current().loaded_ahead.append(server)
    return server


def newest() -> held_arguments.HoldingServer | None:
    """The newest server of what was loaded that has not said it cannot serve (gone or not)."""
    for server in reversed(process.current().loaded_ahead):
        if server.may_serve():
            return server
    return None


def hold_tokenizer(tokenizer) -> HeldTokenizer | None:
    """Hand ``tokenizer``'s Rust tokenizer to a holding server, if none is held yet."""
    state = process.current()
    backend = getattr(tokenizer, "_tokenizer", None)
    if state.held_tokenizer is not None or type(backend) not in reduced_once.costly_types():
        return None
    reduced = backend.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    if not isinstance(reduced, tuple) or len(reduced) < 3:
        return None
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.DEFAULT_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, type(backend): lambda _obj: reduced}  # reduced once
    pickler.dump((backend,))
    if buffer.tell() > MAX_TOKENIZER_BYTES:
        return None
    state.held_tokenizer = HeldTokenizer(_start((backend,), buffer.getvalue()), reduced[2])
    return state.held_tokenizer


class _Imports:
    """Pickled for a server: unpickling it imports the modules."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def __reduce__(self):
        return imported, (self.names,)


def imported(names: tuple[str, ...]) -> tuple[str, ...]:
    """In a holding server: import ``names`` (one that fails is left for whoever needs it), with
    thread pools of one thread, as the warm forkserver imports (a pool started at import would
    leave it unsafe to fork)."""
    from .forkserver import quietly_importing

    with quietly_importing():
        for name in names:
            with contextlib.suppress(Exception):
                importlib.import_module(name)
    return names


def modules_of(loaded, imported_by_the_load) -> list[str]:
    """The model families' modules a load brought, not held yet: those under
    :data:`MODULES_HELD` that it imported, and every module the trainer has of the family of
    ``loaded``'s class and of its attributes' classes (a processor's image processor, say).
    An Auto class imports its class's module before the class's own load runs, and a
    configuration is loaded before either."""
    families = set()
    for kind in (type(loaded), *(type(value) for value in getattr(loaded, "__dict__", {}).values())):
        module = getattr(kind, "__module__", None) or ""
        if module.startswith(MODULES_HELD):
            families.add(".".join(module.split(".")[:3]) + ".")  # transformers.models.<family>.
    found = {name for name in imported_by_the_load if name.startswith(MODULES_HELD)}
    found.update(name for name in list(sys.modules) if (name + ".").startswith(tuple(families)))
    # A module from a file: not an alias transformers makes of another's name.
    found = {name for name in found if getattr(sys.modules.get(name), "__file__", None)}
    given = {name for server in process.current().loaded_ahead if type(server.unit[0]) is tuple
             for name in server.unit[0]}  # the modules servers were given to import
    return sorted(found - given)


def hold_modules(names: list[str]) -> held_arguments.HoldingServer | None:
    """A holding server importing ``names`` (modules the trainer imported), if any."""
    if not names:
        return None
    return _start((tuple(names),), pickle.dumps((_Imports(tuple(names)),), pickle.DEFAULT_PROTOCOL))


def references() -> dict:
    """Reducers for the pickle of a loader's objects for its holding server: the tokenizer held
    ahead, where it is unchanged, is written as a reference to it (with its bytes). Written so
    while its server has not said it cannot hold it, gone or not: the loader's server, started
    elsewhere then, unpickles the bytes, and the bytes compared at the start stay the same."""
    held = process.current().held_tokenizer
    if held is None:
        return {}
    held.server.may_serve()  # reads its answer, if it is in: one that cannot hold it lets its bytes go
    if held.server.data is None:
        return {}
    backend = held.server.unit[0]
    kind = type(backend)
    kept = copyreg.dispatch_table.get(kind)  # while a loader starts: its reduction kept once (reduced_once)

    def reduce(obj):
        reduced = kept(obj) if kept is not None else obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
        if obj is backend and reduced[2] == held.state:
            return held_arguments.held_part, (held.server.key, 0, held.server.data)
        return reduced

    return {kind: reduce}
