"""LeRobot's layouts: where each LeRobot line decodes video, draws its batches and builds
its DataLoaders, as patch-target tables, one per layout.

The layout patched is the first of :data:`LAYOUTS` whose every target the installed
LeRobot defines, with the parameters its stand-in expects: read from LeRobot's source
files (an AST, nothing imported), before anything is patched. So a LeRobot that moved or
changed one of them matches no layout and is left untouched as a whole (one warning),
never patched by half; and a new release with a known layout needs no new adapter.

- ``0.4``: LeRobot 0.4.x and 0.5.0. ``LeRobotDataset._query_videos`` decodes a sample's
  cameras one after another; ``decode_video_frames(video_path, timestamps, tolerance_s,
  backend)``; ``cycle`` in ``lerobot.datasets.utils``.
- ``0.5.1``: reading moved to ``DatasetReader`` (``dataset_reader.py``).
- ``0.6.0``: ``decode_video_frames`` takes ``return_uint8`` and ``is_depth`` (depth maps
  are uint16, from PyAV, dequantized by the reader); ``DatasetReader._query_videos``
  decodes the cameras on threads; ``cycle`` in ``lerobot.utils.utils``.
- ``0.6.1``: 0.6.0, and ``lerobot-train`` starts its workers with
  ``dataloader_multiprocessing_context`` (default spawn) through ``_dataloader_worker_kwargs``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from ...patching.moved_targets import DecodeFunctions
from ...patching.targets import Target, original_of

VIDEO_UTILS = "lerobot.datasets.video_utils"
DATASET = "lerobot.datasets.lerobot_dataset"
READER = "lerobot.datasets.dataset_reader"
STREAMING = "lerobot.datasets.streaming_dataset"
OLD_CYCLE = "lerobot.datasets.utils"
CYCLE = "lerobot.utils.utils"
TRAIN_SCRIPT = "lerobot.scripts.lerobot_train"

DECODE = "swift_safe_media.hosts.lerobot.decode"
SUBSTITUTE = "swift_safe_media.hosts.lerobot.substitute"
WORKERS = "swift_safe_media.hosts.lerobot.workers"

# The parameters of each host function a stand-in replaces, as the stand-in expects them.
DECODE_04 = ("video_path", "timestamps", "tolerance_s", "backend")
DECODE_06 = (*DECODE_04, "return_uint8", "is_depth")
QUERY_VIDEOS = ("self", "query_timestamps", "ep_idx")


@dataclass(frozen=True)
class Row:
    target: Target
    parameters: tuple[str, ...]


def _row(module: str, name: str, stand_in: str, parameters: tuple[str, ...]) -> Row:
    return Row(Target(module, name, stand_in), parameters)


@dataclass(frozen=True)
class Layout:
    name: str
    rows: tuple[Row, ...]
    cameras_on_threads: bool = False  # the reader decodes a sample's cameras on threads

    @property
    def targets(self) -> tuple[Target, ...]:
        return tuple(row.target for row in self.rows)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(row.target.module for row in self.rows))

    def target(self, name: str) -> Target:
        return next(target for target in self.targets if target.name == name)


def _common(decode_parameters, cycle_module, query_videos: Row, streaming_query_videos: str) -> tuple[Row, ...]:
    return (
        _row(VIDEO_UTILS, "decode_video_frames", f"{DECODE}:decode_video_frames", decode_parameters),
        _row(cycle_module, "cycle", f"{WORKERS}:cycle_with_start_method", ("iterable",)),
        _row(DATASET, "LeRobotDataset.__getitem__", f"{SUBSTITUTE}:getitem_or_substitute", ("self", "idx")),
        query_videos,
        _row(STREAMING, "StreamingLeRobotDataset._query_videos", streaming_query_videos, QUERY_VIDEOS),
        _row(STREAMING, "StreamingLeRobotDataset.make_frame", f"{SUBSTITUTE}:make_frame_or_substitute",
             ("self", "dataset_iterator")),
    )


_LAYOUT_06 = _common(DECODE_06, CYCLE,
                     _row(READER, "DatasetReader._query_videos", f"{DECODE}:reader_query_videos", QUERY_VIDEOS),
                     f"{DECODE}:streaming_query_videos")
LAYOUTS = (
    Layout("0.6.1", (*_LAYOUT_06, _row(TRAIN_SCRIPT, "_dataloader_worker_kwargs",
                                       f"{WORKERS}:worker_kwargs_with_start_method", ("cfg",))),
           cameras_on_threads=True),
    Layout("0.6.0", _LAYOUT_06, cameras_on_threads=True),
    Layout("0.5.1", _common(DECODE_04, OLD_CYCLE,
                            _row(READER, "DatasetReader._query_videos", f"{DECODE}:reader_query_videos",
                                 QUERY_VIDEOS),
                            f"{DECODE}:streaming_query_videos")),
    Layout("0.4", _common(DECODE_04, OLD_CYCLE,
                          _row(DATASET, "LeRobotDataset._query_videos", f"{DECODE}:dataset_query_videos",
                               QUERY_VIDEOS),
                          f"{DECODE}:streaming_query_videos")),
)

# video_utils' decoders: decode_video_frames is the target, the backends it calls are inner; a
# new one of this shape is named at start-up.
DECODE_FUNCTIONS = (DecodeFunctions(VIDEO_UTILS, r"^decode_video_frames",
                                    inner=("decode_video_frames_torchvision", "decode_video_frames_torchcodec",
                                           "decode_video_frames_pyav")),)

# Every module any layout patches: what may trigger the patch.
ALL_MODULES = tuple(dict.fromkeys(module for layout in LAYOUTS for module in layout.modules))


# -- reading LeRobot's source -----------------------------------------------------------
def _source_file(module_name: str) -> Path | None:
    """The source file of ``module_name``, found from its top-level package without
    importing anything (a submodule's ``find_spec`` would run its packages' ``__init__``)."""
    top, *parts = module_name.split(".")
    try:
        spec = importlib.util.find_spec(top) if top not in sys.modules else sys.modules[top].__spec__
    except (ImportError, ValueError):
        return None
    locations = list(getattr(spec, "submodule_search_locations", None) or ())
    for location in locations:
        base = Path(location).joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@functools.lru_cache(maxsize=None)
def _definitions(module_name: str) -> dict[str, tuple[str, ...]] | None:
    """``{"function": parameters, "Class.method": parameters}`` defined at the top level of
    ``module_name``'s source (and in its top-level classes), or None without a source."""
    path = _source_file(module_name)
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    found = {}

    def parameters(node) -> tuple[str, ...]:
        arguments = node.args
        return tuple(argument.arg for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = parameters(node)
        elif isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{member.name}"] = parameters(member)
    return found


def mismatches(layout: Layout) -> list[str]:
    """What the installed LeRobot lacks of ``layout``: 'module.name' (missing) or
    'module.name(parameters)' (defined with other parameters)."""
    problems = []
    for row in layout.rows:
        definitions = _definitions(row.target.module)
        found = None if definitions is None else definitions.get(row.target.name)
        if found is None:
            problems.append(f"{row.target.module}.{row.target.name}")
        elif found != row.parameters:
            problems.append(f"{row.target.module}.{row.target.name}({', '.join(found)})")
    return problems


@functools.lru_cache(maxsize=1)
def installed() -> Layout | None:
    """The first layout the installed LeRobot has entirely, or None."""
    return next((layout for layout in LAYOUTS if not mismatches(layout)), None)


def why_none() -> str:
    """Why no layout matches (for the one warning): what the nearest layout lacks."""
    nearest = min(LAYOUTS, key=lambda layout: len(mismatches(layout)))
    return f"no known layout of LeRobot's decode path matches (nearest, {nearest.name}, lacks " \
           f"{', '.join(mismatches(nearest))})"


def stock(name: str):
    """LeRobot's own function ``name`` of the installed layout (unpatched)."""
    target = installed().target(name)
    current = getattr(sys.modules[target.module], target.name)
    return original_of(current) or current
