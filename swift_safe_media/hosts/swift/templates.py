"""Which ms-swift templates need the trainer's model in their DataLoader workers, read
from their source.

ms-swift hands a template its model (``template.model = model``) when the template class
says ``use_model = True``. What runs in a DataLoader worker is the template's ``encode``
(``LazyLLMDataset``, packing) and ``data_collator`` (the ``collate_fn``), and everything
they call. ``Template.__getstate__`` drops ``model``, so a worker started by spawn or a
forkserver gets ``model=None``: encoding that reads ``self.model`` there fails, where
stock ms-swift, which forks its workers on Linux, finds the trainer's model. Encoding
that goes through ``self._get_model()`` is fine: that builds ms-swift's dummy model (no
weights) where the model is missing, as ms-swift's own spawn path, Megatron-SWIFT and
``export --to_cached_dataset`` do.

:func:`model_reads_in_workers` answers for one template class: a static reading of the
methods reachable from those entry points (``self.name`` and ``super().name`` resolved
along the class's MRO, properties included), listing each one that reads ``self.model``
directly. Read once per class, from the host's own source, so it holds for every ms-swift
release and for a user's own registered templates alike.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import types

# What ms-swift runs in a DataLoader worker: the dataset's encode and the collate_fn.
WORKER_ENTRY_POINTS = ("encode", "data_collator")
MODEL_ATTRIBUTE = "model"
# ms-swift's own fallback: the model where there is one, else a dummy model built (on the
# meta device, without weights) where it runs. Not followed: what reaches the model only
# through it encodes in any worker.
FALLBACK = "_get_model"


@functools.lru_cache(maxsize=64)
def parsed_file(filename: str) -> ast.Module | None:
    """A source file's syntax tree, parsed once (``inspect.getsource`` parses the whole
    module again for every class it is asked for)."""
    try:
        with open(filename, encoding="utf-8") as source:
            return ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _class_node(cls: type) -> ast.ClassDef | None:
    try:
        tree = parsed_file(inspect.getsourcefile(cls) or "")
    except (TypeError, OSError):  # built in, or defined where there is no source (python -c)
        return None
    node = tree
    for part in cls.__qualname__.split("."):
        body = getattr(node, "body", [])
        node = next((item for item in body if isinstance(item, ast.ClassDef) and item.name == part), None)
        if node is None:  # a class defined in a function: the file's only class of that name
            named = [item for item in ast.walk(tree) if isinstance(item, ast.ClassDef) and item.name == cls.__name__]
            return named[0] if len(named) == 1 else None
    return node


@functools.lru_cache(maxsize=None)
def _methods_of(cls: type) -> dict[str, ast.AST]:
    """The functions ``cls`` itself defines (methods, properties, static and class
    methods), as syntax trees; empty where its source cannot be read."""
    definition = _class_node(cls)
    if definition is None:
        return {}
    return {node.name: node for node in definition.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _resolve(mro: tuple[type, ...], name: str, after: type | None = None) -> type | None:
    """The class of ``mro`` whose ``name`` a call finds (``after``: ``super()`` in that class)."""
    start = 0 if after is None else mro.index(after) + 1
    for cls in mro[start:]:
        if name in _methods_of(cls):
            return cls
    return None


def _references(function: ast.AST):
    """(kind, name, loads) for each ``self.name`` ("self"), ``super().name`` (("super", None)
    or, for ``super(Class, self)``, ("super", "Class")) and
    ``Class.name`` (kind: the class's name, as in ``Qwen2VLTemplate._post_encode(self, ...)``)
    in ``function``."""
    for node in ast.walk(function):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if isinstance(value, ast.Name):
            yield value.id, node.attr, isinstance(node.ctx, ast.Load)
        elif (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"):
            # super(): after the defining class; super(Class, self): after Class
            start = value.args[0].id if value.args and isinstance(value.args[0], ast.Name) else None
            yield ("super", start), node.attr, True


@functools.lru_cache(maxsize=None)
def model_reads_in_workers(cls: type) -> tuple[str, ...]:
    """``Class.method`` for each method that reads ``self.model`` directly and that the
    worker entry points reach, in ``cls``; empty when none does (or the source is not
    readable: nothing can be said, and nothing is changed)."""
    mro = tuple(klass for klass in cls.__mro__ if klass is not object)
    pending = [(owner, name) for name in WORKER_ENTRY_POINTS if (owner := _resolve(mro, name)) is not None]
    seen, reads = set(pending), []
    by_name = {klass.__name__: klass for klass in mro}
    while pending:
        owner, name = pending.pop()
        function = _methods_of(owner)[name]
        for kind, attribute, loads in _references(function):
            if kind == "self" and attribute == MODEL_ATTRIBUTE:
                if loads and f"{owner.__qualname__}.{name}" not in reads:
                    reads.append(f"{owner.__qualname__}.{name}")
                continue
            if attribute == FALLBACK:
                continue
            if kind == "self":
                target = _resolve(mro, attribute)
            elif isinstance(kind, tuple):
                after = by_name.get(kind[1], owner)
                target = _resolve(mro, attribute, after=after)
            elif kind in by_name:  # Class.method(self, ...): from that class on
                start = by_name[kind]
                target = _resolve(mro[mro.index(start):], attribute)
            else:
                continue
            if target is not None and (target, attribute) not in seen:
                seen.add((target, attribute))
                pending.append((target, attribute))
    return tuple(sorted(reads))


def needs_model_in_workers(template) -> tuple[str, ...]:
    """For a template instance: what reads its model in the workers, if ms-swift gave it
    one (``use_model``, and a model set); empty otherwise."""
    if getattr(template, MODEL_ATTRIBUTE, None) is None or not getattr(type(template), "use_model", False):
        return ()
    return model_reads_in_workers(type(template))


def templates_of(loader, depth: int = 3) -> list:
    """The ms-swift templates a DataLoader's workers will run: found from its dataset and
    its ``collate_fn`` through bound methods (``LazyLLMDataset.encode_func``,
    ``template.data_collator``), ``functools.partial`` and object attributes, ``depth``
    steps deep (what wraps them: packing, accelerate's shards, transformers' column
    remover). Containers are not searched: a dataset's rows are never read."""
    base = sys.modules.get("swift.template.base")
    template_class = getattr(base, "Template", None)
    if template_class is None:
        return []
    found, seen = [], set()
    frontier = [getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)]
    for _ in range(depth + 1):
        following = []
        for value in frontier:
            if value is None or id(value) in seen or isinstance(value, _NOT_SEARCHED):
                continue
            seen.add(id(value))
            if isinstance(value, template_class):
                found.append(value)
            elif isinstance(value, types.MethodType):
                following.append(value.__self__)
            elif isinstance(value, functools.partial):
                following += [value.func, *value.args, *value.keywords.values()]
            else:
                attributes = getattr(value, "__dict__", None)
                if isinstance(attributes, dict):
                    following += [item for item in attributes.values() if not isinstance(item, _NOT_SEARCHED)]
        frontier = following
    return found


_NOT_SEARCHED = (str, bytes, int, float, complex, bool, type, types.ModuleType, types.FunctionType,
                 types.BuiltinFunctionType, list, tuple, dict, set, frozenset)
