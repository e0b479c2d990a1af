"""Which media-opening calls a template reaches that protection does not bound, read
from the sources.

From a template's ``encode`` and ``data_collator`` (what runs in a DataLoader worker),
every method reached through ``self.name``, ``super().name`` and ``Class.name(self)``
along the class's MRO is read (the walk of :mod:`.templates`), and so is every
function it names, in any module (``load_batch(..., load_func=partial(load_audio, ...))``
names ``load_audio`` without calling it), a few steps deep. A name is resolved the way
Python would: by the function's own imports (``from qwen_vl_utils import fetch_video``
inside ``replace_tag``), else the module's globals. Each one is

- **bounded**: a function protection replaces (a twin, or stock run in the sandbox:
  the rows of the ms-swift adapter and of :mod:`...patching.media_libraries`); not followed further;
- **a media opener** (:data:`OPENERS`: ``decord.VideoReader``, ``av.open``,
  ``cv2.VideoCapture``, ``subprocess.run``, ...) reached without passing a bounded
  function: a finding, named by the template method and the call;
- else a Python function of a followed package, read in turn.

The same reading serves the suite (every template of the installed ms-swift, and a
test fails on a finding) and the run: :func:`warn_unbounded` logs one warning per
template and call as a template is built under protection, for ms-swift's templates
and a user's own alike. What is called on an attribute of an object (``self.processor
(...)``) cannot be read here; a template's processor is read as a class of its own.
Templates registered under a name the newest ms-swift release tested here did not register
(:mod:`.known_templates`) are read the same way and listed by :func:`new_templates`; the
run names them in one warning, as its first template is built (a new family, seen the day it lands).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import types

from . import templates as swift_templates
from ...decoders.stock import names_media as _names_media
from ...patching.targets import original_of

log = logging.getLogger("swift_safe_media")

# (top-level package, name) of the calls that open media with native code or a program.
OPENERS = frozenset({
    ("decord", "VideoReader"), ("decord", "AudioReader"), ("decord", "AVReader"),
    ("av", "open"), ("cv2", "VideoCapture"),
    ("torchaudio", "load"), ("torchaudio", "load_with_torchcodec"), ("torchaudio", "StreamReader"),
    ("librosa", "load"), ("librosa", "stream"), ("audioread", "audio_open"),
    ("soundfile", "read"), ("soundfile", "SoundFile"), ("soundfile", "blocks"),
    ("torchvision", "read_video"), ("torchvision", "VideoReader"),
    ("torchcodec", "VideoDecoder"), ("torchcodec", "AudioDecoder"),
    ("moviepy", "VideoFileClip"), ("moviepy", "AudioFileClip"), ("imageio", "get_reader"),
    ("subprocess", "run"), ("subprocess", "Popen"), ("subprocess", "call"), ("subprocess", "check_call"),
    ("subprocess", "check_output"), ("os", "system"), ("os", "popen"),
    ("transformers", "load_video"), ("transformers", "load_audio"), ("whisper", "load_audio"),
})
# Packages whose functions are read when a template names them (and the template's own
# package); anything else (torch, numpy, PIL, the standard library) is taken to decode
# nothing but through the openers below.
FOLLOWED = ("swift", "transformers", "transformers_modules", "qwen_vl_utils", "qwen_omni_utils", "keye_vl_utils",
            "minicpmo", "whisper", "stepaudio2")
DEPTH = 5


BOUNDED, OPENER, UNREAD = "bounded", "unbounded opener", "unreadable code"


@dataclasses.dataclass(frozen=True)
class Reach:
    """``where`` (``Class.method`` or ``module.function``) names ``call``, of ``kind``:
    BOUNDED, OPENER (a media opener no bounded function wraps) or UNREAD (code that
    cannot be read here: a module imported from a model's folder, remote code)."""
    where: str
    call: str
    kind: str

    @property
    def bounded(self) -> bool:
        return self.kind == BOUNDED


def _bounded_targets() -> tuple[set[str], set[int], set[tuple[str, str]]]:
    """Names, live ids and (package, name) of every function protection replaces."""
    from ...patching import media_libraries as media
    from . import adapter as swift

    names, ids, public = set(), set(), set()
    for target in (*swift.TARGETS, *media.TARGETS):
        if target.is_method:
            continue
        names.add(f"{target.module}.{target.name}")
        public.add((target.module.split(".")[0], target.name))
        module = sys.modules.get(target.module)
        live = getattr(module, target.name, None)
        if live is not None:
            ids.update({id(live), id(original_of(live) or live)})
    return names, ids, public


def _attribute(value, name: str):
    """``value.name`` without running anything: no lazy import of a module's ``__getattr__``
    (ms-swift's and transformers' packages import on first access), no property."""
    if isinstance(value, types.ModuleType):
        return vars(value).get(name)
    try:
        found = inspect.getattr_static(value, name, None)
    except Exception:
        return None
    return found.__func__ if isinstance(found, (staticmethod, classmethod)) else found


def _key(dotted: str) -> tuple[str, str]:
    return dotted.split(".")[0], dotted.rsplit(".", 1)[-1]


def _canonical(value) -> str | None:
    if isinstance(value, types.ModuleType):
        return value.__name__
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"{module}.{name}"
    return None


class _Reader:
    def __init__(self, may_import: bool, own_package: str):
        self.may_import = may_import
        self.followed = (*FOLLOWED, own_package)  # a user's template: its helpers are read too
        self.names, self.ids, self.public = _bounded_targets()

    def is_bounded(self, dotted: str | None, value) -> bool:
        if value is not None and (id(value) in self.ids or original_of(value) is not None
                                  or (_canonical(value) or "").startswith("swift_safe_media.")):
            return True
        return dotted is not None and (dotted in self.names or _key(dotted) in self.public)

    def importable(self, dotted: str) -> bool:
        """Whether the top-level package of ``dotted`` is installed here."""
        import importlib.util

        top = dotted.split(".")[0]
        try:
            return top in sys.modules or importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            return False

    def live(self, dotted: str):
        """The object ``dotted`` names, if its module is loaded (or may be imported)."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module_name = ".".join(parts[:cut])
            module = sys.modules.get(module_name)
            if module is None and self.may_import:
                try:
                    module = importlib.import_module(module_name)
                except Exception:
                    module = None
            if module is None:
                continue
            value = module
            for attribute in parts[cut:]:
                value = _attribute(value, attribute)
                if value is None:
                    return None
            return value
        return None


def _local_imports(function: ast.AST, package: str | None) -> dict[str, str]:
    """name -> dotted name, for the imports inside ``function``."""
    names = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level and package:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _dotted_references(function: ast.AST):
    """The outermost ``a.b.c`` chains and bare names read in ``function`` (not ``self``'s)."""
    inner = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(function):
        if id(node) in inner or not isinstance(node, (ast.Attribute, ast.Name)):
            continue
        parts, value = [], node
        while isinstance(value, ast.Attribute):
            parts.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id not in ("self", "cls", "super"):
            yield value.id, list(reversed(parts))


def _resolve_name(root: str, rest: list[str], local: dict[str, str], globals_: dict, reader: _Reader):
    """(dotted name, live object or None) of ``root.rest``."""
    if root in local:
        dotted = ".".join([local[root], *rest])
        return dotted, reader.live(dotted)
    if root not in globals_:
        return None, None
    value = globals_[root]
    base = _canonical(value) if isinstance(value, types.ModuleType) or callable(value) else None
    for attribute in rest:
        value = _attribute(value, attribute)
        if value is None:
            break
    dotted = ".".join([base, *rest]) if base else None
    if value is not None and not isinstance(value, types.ModuleType):
        dotted = _canonical(value) if rest else (dotted or _canonical(value))
    return dotted, value


@functools.lru_cache(maxsize=None)
def _definitions(filename: str) -> dict[int, ast.AST]:
    """Every function of a source file by the line its code object starts at (its first
    decorator's, or its ``def``)."""
    tree = swift_templates.parsed_file(filename)
    found, pending = {}, list(tree.body) if tree is not None else []
    while pending:  # module level and class bodies (a function's own local functions are read with it)
        node = pending.pop()
        if isinstance(node, ast.ClassDef):
            pending += node.body
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.lineno] = node
            if node.decorator_list:
                found[node.decorator_list[0].lineno] = node
    return found


def _function_tree(function) -> ast.AST | None:
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    return _definitions(code.co_filename).get(code.co_firstlineno)


def _module_of(owner) -> tuple[dict, str | None]:
    module = sys.modules.get(getattr(owner, "__module__", ""))
    if module is None:
        return {}, None
    return vars(module), getattr(module, "__package__", None)


def _read(where: str, tree: ast.AST, owner, reader: _Reader, depth: int, seen: set, found: list) -> None:
    """Record what ``tree`` (a method of ``owner``, a class, or a function) names."""
    globals_, package = _module_of(owner)
    local = _local_imports(tree, package)
    for root, rest in _dotted_references(tree):
        dotted, value = _resolve_name(root, rest, local, globals_, reader)
        if dotted is None and value is None:
            continue
        if reader.is_bounded(dotted, value):
            found.append(Reach(where, dotted or _canonical(value) or root, BOUNDED))
            continue
        name = _canonical(value) if value is not None else dotted
        keys = {_key(name)} | ({_key(dotted)} if dotted else set()) if name else set()
        if keys & OPENERS:
            found.append(Reach(where, dotted or name, OPENER))
            continue
        if value is None and root in local and _names_media(dotted) and not reader.importable(local[root]):
            found.append(Reach(where, dotted, UNREAD))  # Step-Audio's `from utils import load_audio`
            continue
        function = inspect.unwrap(value) if isinstance(value, types.FunctionType) else None
        if (function is None or depth >= DEPTH or id(function) in seen
                or (function.__module__ or "").split(".")[0] not in reader.followed):
            continue
        seen.add(id(function))
        subtree = _function_tree(function)
        if subtree is not None:
            _read(f"{function.__module__}.{function.__qualname__}", subtree, function, reader, depth + 1, seen, found)


@functools.lru_cache(maxsize=None)
def media_reach(cls: type, entry_points: tuple[str, ...] = swift_templates.WORKER_ENTRY_POINTS,
                may_import: bool = False) -> tuple[Reach, ...]:
    """Every media-opening call and bounded loader that ``cls``'s entry points reach."""
    reader = _Reader(may_import, cls.__module__.split(".")[0])
    mro = tuple(klass for klass in cls.__mro__ if klass is not object)
    by_name = {klass.__name__: klass for klass in mro}
    pending = [(owner, name) for name in entry_points if (owner := swift_templates._resolve(mro, name)) is not None]
    visited, seen_functions, found = set(pending), set(), []
    while pending:
        owner, name = pending.pop()
        function = swift_templates._methods_of(owner)[name]
        _read(f"{owner.__qualname__}.{name}", function, owner, reader, 0, seen_functions, found)
        for kind, attribute, _ in swift_templates._references(function):
            if kind == "self":
                target = swift_templates._resolve(mro, attribute)
            elif isinstance(kind, tuple):
                target = swift_templates._resolve(mro, attribute, after=by_name.get(kind[1], owner))
            elif kind in by_name:
                target = swift_templates._resolve(mro[mro.index(by_name[kind]):], attribute)
            else:
                continue
            if target is not None and (target, attribute) not in visited:
                visited.add((target, attribute))
                pending.append((target, attribute))
    return tuple(dict.fromkeys(found))


def unbounded(cls: type, **kwargs) -> list[Reach]:
    return [reach for reach in media_reach(cls, **kwargs) if not reach.bounded]


# Processors: what a template's processor runs on the media ms-swift hands it.
PROCESSOR_ENTRY_POINTS = ("__call__", "preprocess", "fetch_videos", "fetch_audio")
PROCESSOR_PARTS = ("video_processor", "feature_extractor", "audio_processor", "image_processor")

_warned: set[tuple[str, str]] = set()


def warn_unbounded(template) -> None:
    """One warning per template (or processor) class and call that protection cannot bound."""
    processor = getattr(template, "processor", None)
    readings = [(type(template), swift_templates.WORKER_ENTRY_POINTS)]
    for part in (processor, *(getattr(processor, name, None) for name in PROCESSOR_PARTS)):
        if part is not None:
            readings.append((type(part), PROCESSOR_ENTRY_POINTS))
    for cls, entry_points in readings:
        for reach in unbounded(cls, entry_points=entry_points):
            if (cls.__qualname__, reach.call) in _warned:
                continue
            _warned.add((cls.__qualname__, reach.call))
            what = ("which protection does not bound" if reach.kind == OPENER else
                    "code that cannot be read before it runs; a decode there is bounded only where it goes "
                    "through a library entry point protection bounds (librosa.load, torchaudio.load, ...)")
            log.warning(f"swift_safe_media: {type(template).__name__}: {reach.where} reaches {reach.call}, "
                        f"{what}: a decode there may run unprotected in this process (no timeout). "
                        f"Wrap it with swift_safe_media.call, or report it.")


_new_templates_warned: list[bool] = []  # a family new since the tested release: named once a run (issue 44)


@dataclasses.dataclass(frozen=True)
class NewTemplate:
    """A registered name not in ``known_templates``: its class, and the scan's findings there."""
    name: str
    cls: str  # module.QualName
    known_class: bool  # the known release had the class (under other names)
    unbounded: tuple[Reach, ...]

    def __str__(self) -> str:
        found = "; ".join(f"{reach.where} reaches {reach.call} ({reach.kind})" for reach in self.unbounded)
        return f"{self.name} ({self.cls}{'' if self.known_class else ', a new class'}): {found or 'bounded'}"


def registered_templates() -> dict[str, type]:
    """name -> class, from this run's ``TEMPLATE_MAPPING`` (empty where the run never imported it)."""
    mapping = getattr(sys.modules.get("swift.template.register"), "TEMPLATE_MAPPING", None) or {}
    return {name: getattr(meta, "template_cls", None) for name, meta in dict(mapping).items()}


def new_templates(may_import: bool = False) -> list[NewTemplate]:
    """The registered templates the known release did not register, by name (each class read once)."""
    from .known_templates import KNOWN_TEMPLATES, KNOWN_TEMPLATE_NAMES
    return [NewTemplate(name, _canonical(cls), _canonical(cls) in KNOWN_TEMPLATES,
                        tuple(unbounded(cls, may_import=may_import))) for name, cls in
            sorted(registered_templates().items()) if name not in KNOWN_TEMPLATE_NAMES and isinstance(cls, type)]


def warn_new_templates() -> None:
    """One warning naming every template new since the known release, as the run's first
    template is built (ms-swift's registry, and a user's own registrations, complete by then)."""
    if _new_templates_warned or not registered_templates():
        return
    _new_templates_warned.append(True)
    import importlib.metadata  # the standard library's, imported by transformers already
    from .known_templates import KNOWN_RELEASE

    if new := new_templates():
        installed = next((found.version for found in importlib.metadata.distributions(name="ms-swift")), "(unknown)")
        log.warning(f"swift_safe_media: {len(new)} template(s) registered here (ms-swift {installed}) that ms-swift "
                    f"{KNOWN_RELEASE}, the newest release swift-safe-media is tested with, does not register: "
                    f"{'; '.join(map(str, new))}. The coverage scan read each one's decode path (above: bounded, or "
                    f"what it reaches unbounded), but these families are not in the tested list: a decode the scan "
                    f"cannot see (a processor's remote code) may run without a timeout. Report them to swift-safe-media.")


def template_built(stock_init, template, *args, **kwargs):
    """``Template.__init__``, then the coverage warnings: for the template built, and for the
    templates new since the known release (each fails open: training goes on)."""
    stock_init(template, *args, **kwargs)
    for warn in (lambda: warn_unbounded(template), warn_new_templates):
        try:
            warn()
        except Exception:
            log.debug("swift_safe_media: coverage reading skipped", exc_info=True)
