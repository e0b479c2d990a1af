"""ms-swift's templates of the decode paths issue 32 added, protected, through
``LazyLLMDataset`` in a DataLoader with two workers, over a clip that blocks stock for ever.

``python -m tests.programs.coverage_templates OUT MEDIA [TEMPLATE...]`` builds each template of
:data:`CASES` and :data:`PLAYLIST_CASES` (or those named)
(ms-swift's own class and meta over a small tokenizer, as ``model_templates`` does: no model
of these families can be built offline) after ``--safe_media true`` went through ms-swift's
real ``parse_args``. Rows: ``MEDIA/good.mp4`` or ``good.wav`` twice and a FIFO made here
(``stuck_<template>.*``; for GLM-4.5V, whose transformers loader refuses a FIFO, an HLS
playlist whose segment is a FIFO) between them;
``LazyLLMDataset`` (not strict) takes another row where a decode fails, as in training.
Each case runs the template's own decoding code: its ``encode`` where a tokenizer (or, for
GLM-4.5V, the real processor built around it) is all it needs, else the step that decodes
(``replace_tag``, or MiDashengLM's ``load_batch``: the rest needs the family's remote processor).
One JSON line per case: the batches drawn, and whether every good row's result equals
stock's (the same code, this process, with nothing patched); the log names the FIFO. First,
a template of the user's own that opens video with OpenCV is built: one warning names it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from swift.template import Template
from swift.utils import parse_args
from tests.programs.model_templates import Family, StandIn, TrainArgs, template_for


@dataclasses.dataclass
class Case:
    family: Family
    kind: str  # "audio" or "video"
    step: str  # "encode", or "replace_tag" (the template's decode, without the processor's step)
    path: str  # what the template decodes through


CASES = [
    Case(Family("llama3_1_omni", "llama3_1_omni", StandIn, "audio"), "audio", "encode", "whisper.load_audio"),
    Case(Family("keye_vl", "keye_vl", StandIn, "video"), "video", "replace_tag", "keye_vl_utils.fetch_video"),
    Case(Family("minicpmo4_5", "minicpmo", StandIn, "video"), "video", "replace_tag",
         "minicpmo.utils.get_video_frame_audio_segments"),
]
SUFFIX = {"audio": ".wav", "video": ".mp4"}


def glm4v_processor(tokenizer):
    """GLM-4.1V and GLM-4.5V's real processor (its image and video processors need no download)."""
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    return Glm4vProcessor(image_processor=Glm4vImageProcessor(), tokenizer=tokenizer,
                          video_processor=Glm4vVideoProcessor(), chat_template=None)


GLM4V_SPECIALS = ("<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                  "<|end_of_video|>")
# The paths whose transformers loader refuses a FIFO before opening it (as stock does): the
# clip that blocks them for ever is an HLS playlist whose one segment is a FIFO.
PLAYLIST_CASES = [
    Case(Family("glm4_5v", "glm4v", StandIn, "video", GLM4V_SPECIALS, processor=glm4v_processor), "video",
         "encode", "transformers.video_utils.load_video"),
    # MiDashengLM's processor is the model's remote code (not buildable offline): its step is
    # the decode its ``_encode`` runs before the processor, through the template module's own names.
    Case(Family("midashenglm", "midashenglm", StandIn, "audio"), "audio", "load_batch",
         "transformers.audio_utils.load_audio"),
]


def stuck(case: Case, media: str) -> str:
    """The case's own FIFO, or playlist (one per case: the registry refuses a path that failed before)."""
    suffix = ".m3u8" if case.family.template_type == "glm4_5v" else SUFFIX[case.kind]
    return os.path.join(media, f"stuck_{case.family.template_type}{suffix}")


def make_stuck(case: Case, media: str) -> None:
    path = stuck(case, media)
    if case not in PLAYLIST_CASES:
        os.mkfifo(path)
        return
    segment = path + ".segment.ts"
    os.mkfifo(segment)
    with open(path, "w") as playlist:
        playlist.write("#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:10\n"
                       f"#EXTINF:10.0,\n{os.path.basename(segment)}\n#EXT-X-ENDLIST\n")


def rows(case: Case, media: str) -> list[dict]:
    good = os.path.join(media, "good" + SUFFIX[case.kind])
    return [{"messages": [{"role": "user", "content": f"<{case.kind}>What is in it?"},
                          {"role": "assistant", "content": "a test pattern"}], f"{case.kind}s": [path]}
            for path in (good, stuck(case, media), good)]


def decoded(value):
    """What a template decoded, as tensors to compare (PIL frames as arrays)."""
    import numpy as np

    if isinstance(value, dict):
        return {key: decoded(item) for key, item in value.items() if key not in ("labels", "loss_scale")}
    if isinstance(value, (list, tuple)):
        return [decoded(item) for item in value]
    if hasattr(value, "getpixel"):
        return torch.from_numpy(np.asarray(value).copy())
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    return value


class Step:
    """The dataset's ``encode_func``: the template's own decoding step on one row."""

    def __init__(self, template, case: Case):
        self.template, self.case = template, case

    def __call__(self, row, **_encode_options):
        if self.case.step == "encode":
            return {"out": decoded(self.template.encode(row))}
        if self.case.step == "load_batch":
            from functools import partial

            import transformers.audio_utils
            from swift.template.templates import midashenglm

            load = partial(transformers.audio_utils.load_audio, sampling_rate=self.template.sampling_rate)
            return {"out": decoded(midashenglm.load_batch(row[f"{self.case.kind}s"], load))}
        from swift.template.template_inputs import TemplateInputs

        inputs = TemplateInputs.from_dict(row).chosen
        context = self.template.replace_tag(self.case.kind, 0, inputs)
        return {"out": decoded({"context": context, "images": inputs.images, "videos": inputs.videos,
                                "audios": inputs.audios})}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def run(case: Case, media: str, start_method: str) -> dict:
    from swift.dataset.utils import LazyLLMDataset
    from swift_safe_media.patching import media_libraries as libraries

    template = template_for(case.family, os.path.join(media, "model"))
    dataset = LazyLLMDataset(rows(case, media), Step(template, case), strict=False, n_try_fetch=6)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, shuffle=False,
                                         multiprocessing_context=start_method)
    outs = [row["out"] for row in loader]
    libraries.PATCHES.unpatch()  # stock: the same step on the good clip, nothing bounded
    try:
        stock = Step(template, case)(rows(case, media)[0])["out"]
    finally:
        libraries.PATCHES.patch()
    return {"template": case.family.template_type, "path": case.path, "batches": len(outs),
            "all_equal_stock": all(same(out, stock) for out in outs)}


class UsersOwnVideoTemplate(Template):
    def replace_tag(self, media_type, index, inputs):
        import cv2
        capture = cv2.VideoCapture(inputs.videos[index])
        return [f"{int(capture.get(cv2.CAP_PROP_FRAME_COUNT))} frames"]


def users_own_template():
    """A template of the user's own, registered with ms-swift and built under protection:
    its ``replace_tag`` opens the video with OpenCV, which protection does not bound, so
    building it logs one warning naming the template and the call."""
    from swift.template import TemplateMeta, register_template

    register_template(TemplateMeta("users_own_video", prefix=[], prompt=["{{QUERY}}"], chat_sep=None,
                                   template_cls=UsersOwnVideoTemplate))
    template_for(Family("users_own_video", "llama3_1_omni", StandIn, "video"), "/nonexistent")


def main(out: str, media: str, *only: str) -> None:
    """``only``: the template types to run (all by default)."""
    # The registry a training run keeps under its output folder: ms-swift's own retries of a
    # row, and the other worker, are refused at once instead of waiting out the timeout again.
    args, _ = parse_args(TrainArgs, ["--safe_media", "true", "--safe_media_timeout", "10",
                                     "--safe_media_quarantine", os.path.join(out, "quarantine.jsonl")])
    os.environ["USE_AUDIO_IN_VIDEO"] = "true"  # MiniCPM-o: its video-with-audio path
    users_own_template()
    for case in CASES + PLAYLIST_CASES:
        if only and case.family.template_type not in only:
            continue
        make_stuck(case, media)
        print(json.dumps(run(case, media, args.dataloader_multiprocessing_context)), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
