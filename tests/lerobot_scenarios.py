"""LeRobot scenarios the tests run in fresh interpreters: ``python tests/lerobot_scenarios.py
NAME ARGS...`` prints one JSON line (last line of stdout) describing what happened.

Fresh interpreters because patches, the start-up hook and the environment are
process-wide, and because the unprotected runs hang for real.
"""

import importlib.util
import json
import sys
import time
from pathlib import Path

CAMERA = "observation.images.front"
SECOND_CAMERA = "observation.images.wrist"


DEPTH_CAMERA = "observation.images.depth"


def build(root, episodes="6", frames="10", cameras="1", vcodec="h264", depth="0", file_per_episode="1"):
    """A LeRobotDataset recorded with LeRobot's own API, one video file per episode (or,
    with ``file_per_episode=0``, LeRobot's default: episodes share a file, which its
    streaming dataset needs); ``depth=1`` adds a depth camera (LeRobot 0.6: 12-bit HEVC,
    dequantized on reading)."""
    import inspect

    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    shape = (48, 64, 3) if vcodec == "h264" else (64, 96, 3)  # SVT-AV1 needs 64 lines
    keys = (CAMERA, SECOND_CAMERA)[:int(cameras)]
    features = {
        **{key: {"dtype": "video", "shape": shape, "names": ["height", "width", "channels"]} for key in keys},
        "observation.state": {"dtype": "float32", "shape": (2,), "names": None},
        "action": {"dtype": "float32", "shape": (2,), "names": None},
    }
    if int(depth):
        features[DEPTH_CAMERA] = {"dtype": "video", "shape": (*shape[:2], 1), "names": ["height", "width", "channels"],
                                  "info": {"is_depth_map": True}}
    if "vcodec" in inspect.signature(LeRobotDataset.create).parameters:  # 0.4 - 0.5
        codec = {"vcodec": vcodec}
    else:  # 0.6: encoder settings
        from lerobot.configs import RGBEncoderConfig

        codec = {"rgb_encoder": RGBEncoderConfig(vcodec=vcodec)}
    dataset = LeRobotDataset.create("local/safe_media_test", fps=30, features=features, root=root,
                                    use_videos=True, **codec)
    if int(file_per_episode):  # any positive size below one episode's video starts a new file per episode
        dataset.meta.update_chunk_settings(video_files_size_in_mb=1e-9)
    random = np.random.default_rng(0)
    texture = random.integers(0, 64, shape, dtype=np.uint8)
    for episode in range(int(episodes)):
        for frame in range(int(frames)):
            images = {key: (texture * (number + 1) + (episode * 40 + frame * 5) % 256).astype(np.uint8)
                      for number, key in enumerate(keys)}
            if int(depth):  # millimetres, as a depth camera gives them
                images[DEPTH_CAMERA] = random.integers(200, 3000, (*shape[:2], 1)).astype(np.uint16)
            dataset.add_frame({**images, "observation.state": np.array([episode, frame], np.float32),
                               "action": np.zeros(2, np.float32), "task": "pick"})
        dataset.save_episode()
    dataset.finalize()
    return {"frames": len(dataset), "episodes": int(episodes)}


def slow_video(path, width="96", height="64", hidden="500000"):
    """Replace the video at ``path`` by a valid one of the same size whose every frame takes
    seconds to decode: a very long GOP. One keyframe, then ``hidden`` frames an edit list
    keeps from being shown, then the 10 frames that are: reaching any shown frame decodes
    all hidden ones (5.7 s of CPU here; the CPU does the waiting, not I/O).
    Should a decode ever finish, its timestamps miss LeRobot's tolerance: an error, never
    a frame of the wrong size. Written with PyAV: two encoded frames, the second (all
    skipped macroblocks) repeated, so it takes a second to build, not minutes."""
    import fractions

    import av
    import numpy as np

    encoder = av.CodecContext.create("mpeg2video", "w")
    encoder.width, encoder.height, encoder.pix_fmt = int(width), int(height), "yuv420p"
    encoder.time_base, encoder.framerate, encoder.gop_size = fractions.Fraction(1, 30), 30, 1 << 30
    gray = av.VideoFrame.from_ndarray(np.full((int(height), int(width), 3), 128, np.uint8), format="rgb24")
    encoded = []
    for number in range(2):
        frame = gray.reformat(format="yuv420p")
        frame.pts = number
        encoded += [bytes(packet) for packet in encoder.encode(frame)]
    encoded += [bytes(packet) for packet in encoder.encode(None)]
    keyframe, skipped = encoded[0], encoded[1]
    out = av.open(str(path), "w", format="mp4")
    stream = out.add_stream("mpeg2video", rate=30)
    stream.width, stream.height, stream.pix_fmt = int(width), int(height), "yuv420p"
    stream.time_base = fractions.Fraction(1, 30)
    hidden = int(hidden)
    for number in range(hidden + 10):
        packet = av.Packet(keyframe if number == 0 else skipped)
        packet.stream, packet.time_base = stream, stream.time_base
        packet.pts = packet.dts = number - hidden  # negative: before the edit list's start
        packet.is_keyframe = number == 0
        out.mux(packet)
    out.close()
    return {"frames": hidden + 10}


def item_digests(root, backend="", return_uint8="0", kind="map"):
    """Every sample's camera tensors (the current frame and the one before it), hashed
    bit for bit, read in this process as a training script would. All samples are kept
    until the end, so memory recycled for a later sample while an earlier one still
    holds it would show as a changed digest. ``kind``: ``map`` (LeRobotDataset), ``multi``
    (MultiLeRobotDataset of it, twice) or ``streaming`` (StreamingLeRobotDataset, local)."""
    import hashlib

    import torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    probe = LeRobotDataset("local/safe_media_test", root=root)
    deltas = {key: [-1 / probe.fps, 0.0] for key in probe.meta.video_keys}
    options = {"delta_timestamps": deltas, **({"video_backend": backend} if backend else {}),
               **({"return_uint8": True} if int(return_uint8) else {})}
    if kind == "streaming":
        from lerobot.datasets.streaming_dataset import StreamingLeRobotDataset

        options.pop("video_backend", None)  # streaming decodes RGB with torchcodec, always
        dataset = StreamingLeRobotDataset("local/safe_media_test", root=root, shuffle=False, buffer_size=1,
                                          max_num_shards=1, **options)
        items = sorted(dataset, key=lambda item: int(item["index"]))
    elif kind == "multi":
        dataset = _multi_dataset(root, options)
        items = [dataset[index] for index in range(len(dataset))]
    else:
        dataset = LeRobotDataset("local/safe_media_test", root=root, **options)
        items = [dataset[index] for index in range(len(dataset))]
    depth_keys = set(getattr(probe.meta, "depth_keys", ()))
    digests = []
    for item in items:
        for key in probe.meta.video_keys:
            frames = item[key]
            rgb_dtype = torch.uint8 if int(return_uint8) else torch.float32
            assert frames.dtype == (torch.float32 if key in depth_keys else rgb_dtype), (key, frames.dtype)
            assert frames.shape[0] == 2, (key, frames.shape)
            digests.append(f"{key} {tuple(frames.shape)} {frames.dtype} "
                           f"{hashlib.sha256(frames.contiguous().numpy().tobytes()).hexdigest()}")
    from swift_safe_media.hosts.lerobot import adapter

    return {"digests": digests, "patched": adapter.is_patched(), "keys": list(probe.meta.video_keys),
            "items": len(items)}


def all_digests(root, streaming_root="", every="1"):
    """``item_digests`` of every way of reading LeRobot 0.6 offers (torchcodec and PyAV,
    float and uint8, MultiLeRobotDataset, and StreamingLeRobotDataset over
    ``streaming_root``), in one process; older LeRobot, or ``every=0``: the default only."""
    import inspect

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    variants = {"torchcodec": (root, "torchcodec", "0", "map")}
    if int(every) and "return_uint8" in inspect.signature(LeRobotDataset.__init__).parameters:
        variants.update({"pyav": (root, "pyav", "0", "map"), "uint8": (root, "torchcodec", "1", "map"),
                         "pyav_uint8": (root, "pyav", "1", "map"), "multi": (root, "", "0", "multi")})
        if streaming_root:
            variants["streaming_uint8"] = (streaming_root, "", "1", "streaming")
    results = {name: item_digests(*arguments) for name, arguments in variants.items()}
    return {"digests": {name: result["digests"] for name, result in results.items()},
            "patched": results["torchcodec"]["patched"], "keys": results["torchcodec"]["keys"]}


def _multi_dataset(root, options):
    """A MultiLeRobotDataset of the dataset at ``root`` and a copy of it (a second repo)."""
    import shutil

    try:
        from lerobot.datasets.multi_dataset import MultiLeRobotDataset  # 0.5.1 on
    except ImportError:
        from lerobot.datasets.lerobot_dataset import MultiLeRobotDataset
    copy = Path(str(root) + "-copy")
    if not copy.exists():
        shutil.copytree(root, copy)
    parent = Path(root).parent
    roots = {"local/" + Path(root).name: root, "local/" + copy.name: copy}
    for repo_id, folder in roots.items():  # MultiLeRobotDataset finds each under root/repo_id
        link = parent / "multi" / repo_id
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(Path(folder).resolve())
    options = {key: value for key, value in options.items() if key != "return_uint8"}
    return MultiLeRobotDataset(list(roots), root=parent / "multi", **options)


def epoch(root, start_method="none", num_workers="2"):
    """One epoch of DataLoader(num_workers=2) over the dataset at ``root``."""
    import torch.utils.data
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset("local/safe_media_test", root=root)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=4, num_workers=int(num_workers), shuffle=False,
        multiprocessing_context=None if start_method == "none" else start_method)
    started = time.monotonic()
    batches = samples = 0
    states = []
    shape = tuple(dataset.meta.features[CAMERA]["shape"])
    for batch in loader:
        assert batch[CAMERA].shape[1:] == (shape[2], *shape[:2]), batch[CAMERA].shape
        batches += 1
        samples += len(batch["index"])
        states += batch["observation.state"].tolist()
        print(f"batch {batches}", flush=True)
    return {"batches": batches, "samples": samples, "expected_batches": len(loader),
            "states": states, "seconds": time.monotonic() - started}


def remote_frames(root):
    """A camera's frames read over HTTP (a local server, as a dataset streamed from the Hub is
    read) and from the file itself, both through protection's decode: equal, and the remote
    one from a download's sandbox (confined, but it may connect out), which stays for the next."""
    import functools
    import http.server
    import threading

    import swift_safe_media
    from swift_safe_media.engine.calls import NETWORK, get_engine
    from swift_safe_media.hosts.lerobot import decode as lerobot_decode

    swift_safe_media.enable(hosts=["lerobot"])
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relative = f"videos/{CAMERA}/chunk-000/file-000.mp4"
    url = f"http://127.0.0.1:{server.server_address[1]}/{relative}"
    timestamps = [0.0, 1 / 30]
    (remote,) = lerobot_decode.decode_in_sandbox([(url, timestamps, 1e-4, "torchcodec", True, False)])
    (again,) = lerobot_decode.decode_in_sandbox([(url, timestamps[1:], 1e-4, "torchcodec", True, False)])
    (local,) = lerobot_decode.decode_in_sandbox([(Path(root) / relative, timestamps, 1e-4, "torchcodec", True, False)])
    server.shutdown()
    network = get_engine(NETWORK).stats
    return {"equal": bool((remote == local).all() and (again[0] == local[1]).all()), "shape": list(remote.shape),
            "network_calls": network["calls"], "network_sandboxes": network["sandboxes_started"],
            "unconfined_calls": get_engine(False).stats["calls"], "confined_calls": get_engine(True).stats["calls"]}


def stream(root):
    """Every frame of a StreamingLeRobotDataset over the local dataset at ``root``."""
    from lerobot.datasets.streaming_dataset import StreamingLeRobotDataset

    dataset = StreamingLeRobotDataset("local/safe_media_test", root=root, shuffle=False, buffer_size=1,
                                      max_num_shards=1)
    frames = 0
    for _ in dataset:
        frames += 1
        print(f"frame {frames}", flush=True)
    return {"frames": frames}


def train_loop(root, steps="20"):
    """Batches drawn the way lerobot-train draws them: ``next()`` on ``cycle(dataloader)``."""
    import torch.utils.data
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.datasets.utils import cycle

    dataset = LeRobotDataset("local/safe_media_test", root=root)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    batches = cycle(loader)
    for step in range(int(steps)):
        batch = next(batches)
        assert batch[CAMERA].shape[1:] == (3, 48, 64), batch[CAMERA].shape
    context = loader.multiprocessing_context
    return {"steps": int(steps), "start_method": None if context is None else context.get_start_method()}


def patch_state():
    """Where LeRobot's functions stand: ours (patched) or its own."""
    import lerobot.datasets.lerobot_dataset as lerobot_dataset
    import lerobot.datasets.utils as dataset_utils
    import lerobot.datasets.video_utils as video_utils

    from swift_safe_media.engine import pool
    from swift_safe_media.patching import targets as _patching
    from swift_safe_media.hosts.lerobot import adapter

    def ours(function):
        return _patching.original_of(function) is not None

    return {
        "video_utils": ours(video_utils.decode_video_frames),
        "lerobot_dataset": ours(lerobot_dataset.decode_video_frames),
        "same_object": lerobot_dataset.decode_video_frames is video_utils.decode_video_frames,
        "getitem": ours(lerobot_dataset.LeRobotDataset.__getitem__),
        "cycle": ours(dataset_utils.cycle),
        "is_patched": adapter.is_patched(),
        "sites": sorted(f"{module}.{name}" for module, name in adapter.PATCHES.sites()),
        "sandbox_setup": adapter.import_lerobot_in_sandbox in pool.sandbox_setups(),
    }


def import_order(order):
    """enable()/disable() before or after LeRobot's import, twice, and the states seen."""
    import swift_safe_media

    states = []
    if order == "enable_first":
        swift_safe_media.enable(hosts=["lerobot"])
        import lerobot.datasets.lerobot_dataset  # noqa: F401
    else:
        import lerobot.datasets.lerobot_dataset  # noqa: F401
        swift_safe_media.enable(hosts=["lerobot"])
    states.append(patch_state())
    swift_safe_media.enable(hosts=["lerobot"])  # twice: no double wrapping
    states.append(patch_state())
    swift_safe_media.disable()
    states.append(patch_state())
    swift_safe_media.enable(hosts=["lerobot"])
    states.append(patch_state())
    swift_safe_media.disable()
    return {"states": states}


def flags(*argv):
    """LeRobot's own ``parser.wrap`` (draccus) over a command line carrying our flags."""
    import dataclasses
    import os

    sys.argv[1:] = list(argv)
    from lerobot.configs import parser

    @dataclasses.dataclass
    class Config:
        batch_size: int = 8
        num_workers: int = 4
        output_dir: str | None = None

    @parser.wrap()
    def main(cfg: Config):
        return dataclasses.asdict(cfg)

    parsed = main()
    import lerobot.datasets.lerobot_dataset  # noqa: F401

    return {"parsed": parsed, "argv": sys.argv[1:], "state": patch_state(),
            "env": {name: value for name, value in os.environ.items() if name.startswith("SWIFT_SAFE_MEDIA")}}


def start_method():
    """How ``lerobot.datasets.utils.cycle`` leaves the start method of DataLoaders."""
    import dataclasses
    import os

    import torch.utils.data
    from lerobot.datasets.utils import cycle

    from swift_safe_media.hosts.lerobot import adapter

    data = torch.utils.data.TensorDataset(torch.arange(8))

    def after_cycle(**kwargs):
        loader = torch.utils.data.DataLoader(data, batch_size=4, **kwargs)
        next(cycle(loader))
        context = loader.multiprocessing_context
        return None if context is None else context.get_start_method()

    @dataclasses.dataclass
    class NewerTrainConfig:  # stands for versions that have the field
        dataloader_multiprocessing_context: str | None = None

    # LeRobot 0.4.4's TrainPipelineConfig, read from source: importing it pulls in every
    # policy, and some need transformers < 5, which this environment does not have.
    train_config = Path(importlib.util.find_spec("lerobot").origin).parent / "configs" / "train.py"

    def inner_after_cycle(wrap):
        """The start method of the torch DataLoader inside ``wrap(loader)``, after cycle."""
        loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)
        next(cycle(wrap(loader)))
        return loader.multiprocessing_context.get_start_method() if loader.multiprocessing_context else None

    class Forwarding:
        """Forwards reads to the loader, keeps writes to itself, starts it lazily (as
        accelerate's DataLoaderShard does)."""

        def __init__(self, loader):
            self.__dict__["loader"] = loader

        def __getattr__(self, name):
            return getattr(self.loader, name)

        def __iter__(self):
            yield from self.loader

    def under_accelerate():
        """lerobot-train's way: cycle over ``accelerator.prepare(loader)``, whose wrapper
        keeps attribute writes to itself and runs a torch DataLoader of its own."""
        from accelerate import Accelerator

        prepared = Accelerator(cpu=True).prepare(
            torch.utils.data.DataLoader(data, batch_size=4, num_workers=2))
        next(cycle(prepared))
        context = prepared.base_dataloader.multiprocessing_context
        return None if context is None else context.get_start_method()

    workers = after_cycle(num_workers=2)
    forwarded = inner_after_cycle(Forwarding)
    accelerated = under_accelerate()
    os.environ["SWIFT_SAFE_MEDIA_MP_CONTEXT"] = "forkserver"
    workers_forkserver = after_cycle(num_workers=2)
    os.environ["SWIFT_SAFE_MEDIA_MP_CONTEXT"] = "default"
    return {
        "workers": workers,
        "forwarding_wrapper": forwarded,
        "accelerate_prepared": accelerated,
        "workers_forkserver": workers_forkserver,
        "workers_default": after_cycle(num_workers=2),
        "user_choice": after_cycle(num_workers=2, multiprocessing_context="fork"),
        "no_workers": after_cycle(num_workers=0),
        "train_config_0_4_4_has_field": "dataloader_multiprocessing_context" in train_config.read_text(),
        "newer_has_field": adapter.train_config_has_start_method(NewerTrainConfig),
    }


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    name, *args = sys.argv[1:]
    del sys.argv[1:]
    if name == "flags":
        result = flags(*args)
    else:
        result = globals()[name](*args)
    print(json.dumps(result), flush=True)
