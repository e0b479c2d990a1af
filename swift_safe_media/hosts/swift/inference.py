"""ms-swift beyond the DataLoader: inference, serving, export and GRPO rollouts, where a
row or a request whose media fail fails alone, never the run.

Each command encodes its rows somewhere else, and each gets the host's own way out
(the patch targets are :data:`TARGETS`, rows of the ms-swift adapter's table):

- ``swift infer`` over a dataset (``SwiftInfer._batch_infer``): the engine runs the batch
  with ``strict`` off, so a row whose encode fails comes back as its exception (ms-swift's
  own ``_batch_encode`` / ``_batch_infer_stream`` paths, the same for every backend); a
  ``MediaDecodeError`` becomes an error record in the result file (the row, ``"response":
  null``, ``"media_error"``: file, reason, type); any other exception ends the run, as stock.
  ``--metric`` scores the rows answered (``SwiftInfer._calc_metric``). With ``--stream
  true`` ms-swift asks row by row (``SwiftInfer.infer_dataset``): the same error records.
- ``swift deploy``: the transformers engine batches concurrent requests and encodes them
  together (``InferEngine._batch_encode``); a request whose media fail fails alone. Its
  HTTP 400 naming the file, and a media URL's download and decode within one timeout,
  without holding the event loop: :mod:`.serving`.
- ``swift export --to_cached_dataset`` and pre-tokenised training: ms-swift's ``map``
  leaves the row out; nothing to patch but the log's wording.
- ``swift rlhf --rlhf_type grpo`` (``GRPOTrainer._rollout_samples``): rows are checked
  before the rollout and a row whose media fail is replaced (see :mod:`.rollouts`).

The log line of a failed decode says what happens next in this mode (:func:`consequence`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os

from ...records import summary
from ...errors import MediaDecodeError, MediaQuarantined
from ...patching.targets import Target

log = logging.getLogger("swift_safe_media")

_HERE = "swift_safe_media.hosts.swift.inference"
_SERVING = "swift_safe_media.hosts.swift.serving"
TARGETS = (
    Target("swift.infer_engine.infer_engine", "InferEngine._batch_encode", f"{_HERE}:encode_each_request"),
    Target("swift.pipelines.infer.infer", "SwiftInfer._batch_infer", f"{_HERE}:batch_infer_with_error_records"),
    Target("swift.pipelines.infer.infer", "SwiftInfer.infer_dataset", f"{_HERE}:stream_rows_with_error_records"),
    Target("swift.pipelines.infer.infer", "SwiftInfer._calc_metric", f"{_HERE}:metric_over_answered_rows"),
    Target("swift.pipelines.infer.deploy", "SwiftDeploy.create_error_response", f"{_SERVING}:error_naming_media"),
    Target("swift.pipelines.infer.deploy", "SwiftDeploy.create_chat_completion", f"{_SERVING}:serve_chat_completion"),
    Target("swift.pipelines.infer.deploy", "SwiftDeploy._materialize_media", f"{_SERVING}:file_named_with_its_download",
           expected_in="ms-swift>=4.6"),
    Target("swift.utils.url_utils", "SafeUrlFetcher.read", f"{_SERVING}:read_url_within_timeout",
           expected_in="ms-swift>=4.6"),
    Target("swift.rlhf_trainers.grpo_trainer", "GRPOTrainer._rollout_samples",
           "swift_safe_media.hosts.swift.rollouts:rollout_with_media_checked", expected_in="ms-swift>=4.4"),
)

# What happens to a row (or a request) whose media fail, by mode: the end of the log line.
CONSEQUENCES = {
    "train": "ms-swift takes another sample",
    "encode_ahead": "ms-swift leaves the row out",
    "infer": "its row is answered with an error record",
    "deploy": "its request is answered with HTTP 400",
    "rollout": "the rollout takes another row in its place",
}


@dataclasses.dataclass
class Mode:
    """What this process's ms-swift command does with a row whose media fail."""
    name: str = "train"  # DataLoader workers (started by a forkserver) keep the default


MODE = Mode()


def choose_mode(args) -> str:
    """The mode of the command whose arguments ms-swift has just parsed."""
    from swift import arguments

    def kind(name):
        return getattr(arguments, name, None) or type(None)

    if isinstance(args, kind("DeployArguments")):
        mode = "deploy"
    elif isinstance(args, kind("InferArguments")):
        mode = "infer"
    elif isinstance(args, kind("ExportArguments")):
        mode = "encode_ahead"
    elif getattr(args, "rlhf_type", None) == "grpo" and not type(args).__module__.startswith("swift.megatron"):
        mode = "rollout"  # GRPOTrainer's rollouts (Megatron-SWIFT's GRPO has rollouts of its own)
    elif getattr(args, "lazy_tokenize", True) is False:
        mode = "encode_ahead"
    else:
        mode = "train"
    MODE.name = mode
    return mode


def run_folder(args) -> str | None:
    """Where a command that is not training keeps its registry and summary: next to the
    results of ``swift infer`` (``<result_path minus .jsonl>_safe_media``, one per run, as
    a training run's is in its versioned output_dir), in the output_dir of ``swift export``."""
    if MODE.name in ("infer", "deploy") and getattr(args, "result_path", None):
        return os.path.splitext(args.result_path)[0] + "_safe_media"
    if MODE.name == "encode_ahead" and getattr(args, "output_dir", None):
        return os.path.join(args.output_dir, "safe_media")
    return None


def consequence() -> str:
    return CONSEQUENCES[MODE.name]


# The last files that failed here, with how: ms-swift's Template.encode tries a row three
# times at once, and the registry refuses the file on the second and third tries.
_RECENT_FAILURES: collections.OrderedDict = collections.OrderedDict()
_RECENT_KEPT = 256


def first_of_its_row(exc: MediaDecodeError) -> bool:
    """Whether a failure is worth its log line: not the registry refusing ms-swift's retry
    of a row whose file has just failed (that line was logged)."""
    if isinstance(exc, MediaQuarantined):
        return exc.path not in _RECENT_FAILURES
    _RECENT_FAILURES[exc.path] = exc
    _RECENT_FAILURES.move_to_end(exc.path)
    while len(_RECENT_FAILURES) > _RECENT_KEPT:
        _RECENT_FAILURES.popitem(last=False)
    return True


def describe(exc: MediaDecodeError) -> dict:
    """The failure as data: what an error record and an HTTP error body carry; for the
    registry's refusal of ms-swift's retry, the failure it refers to."""
    if isinstance(exc, MediaQuarantined):
        exc = _RECENT_FAILURES.get(exc.path, exc)
    return {"file": exc.path, "reason": exc.reason, "type": type(exc).__name__}


def media_failure(exc: BaseException) -> MediaDecodeError | None:
    """The MediaDecodeError behind ``exc`` (itself, or what it was raised from), if any."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MediaDecodeError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


# --- every engine: a request's media fail that request alone ------------------------------

def encode_each_request(stock, engine, infer_requests, strict=True):
    """``InferEngine._batch_encode`` while serving: stock raises the first failure of a
    batch when ``strict`` (deploy's engine), failing every request batched with it. A
    request whose media fail now gets its own error (ms-swift's non-strict error list);
    any other failure is raised as before. Elsewhere (a GRPO trainer's engine) as stock."""
    if MODE.name != "deploy":
        return stock(engine, infer_requests, strict=strict)
    batched, errors = stock(engine, infer_requests, strict=False)
    if strict:
        for _, error in errors:
            if media_failure(error) is None:
                raise error
    return batched, errors


# --- swift infer: an error record per failed row -------------------------------------------

class _FailedRow:
    """Stands in for a failed row's response in ms-swift's own record building."""

    def __init__(self):
        message = type("Message", (), {"content": None})()
        self.choices = [type("Choice", (), {"message": message, "logprobs": None})()]


def batch_infer_with_error_records(stock, pipeline, val_dataset, request_config):
    """``SwiftInfer._batch_infer``: ms-swift's own loop, with each row whose media fail
    answered by an error record instead of ending the run."""
    engine = pipeline.infer_engine
    failures: dict[int, MediaDecodeError] = {}
    stock_infer = pipeline.infer

    def infer_keeping_going(infer_requests, *args, **kwargs):
        responses = stock_infer(infer_requests, *args, **kwargs)
        for index, response in enumerate(responses):
            if isinstance(response, BaseException):
                failure = media_failure(response)
                if failure is None:
                    raise response  # not ours: the run ends as stock's does
                failures[index] = failure
                responses[index] = _FailedRow()
        return responses

    had_strict = "strict" in vars(engine)
    strict = getattr(engine, "strict", True)
    engine.strict = False  # ms-swift's own way to get each request's error back
    vars(pipeline)["infer"] = infer_keeping_going
    try:
        records = stock(pipeline, val_dataset, request_config)
    finally:
        del vars(pipeline)["infer"]
        if had_strict:
            engine.strict = strict
        else:
            del engine.strict
    for index, failure in sorted(failures.items()):
        if index < len(records):  # vLLM's tensor-parallel ranks other than the first keep none
            _as_error_record(records[index], failure)
    return records


def _as_error_record(record: dict, failure: MediaDecodeError) -> None:
    messages = record.get("messages")
    if messages and messages[-1] == {"role": "assistant", "content": None}:
        messages.pop()  # the row as it was given
    record["response"] = None
    record["media_error"] = describe(failure)
    summary.note_failed_row()


def stream_rows_with_error_records(stock, pipeline):
    """``SwiftInfer.infer_dataset`` with ``--stream true``: ms-swift asks row by row
    (``infer_single``) and writes each record as it is answered; a row whose media fail
    gets its error record there too, instead of ending the run. (The interactive
    ``swift infer``, which also asks through ``infer_single``, is left as stock.)"""
    request_config = pipeline.args.get_request_config()
    if MODE.name != "infer" or not getattr(request_config, "stream", False):
        return stock(pipeline)
    pending: list[MediaDecodeError] = []  # the failure of the row being written next
    stock_single, writer = pipeline.infer_single, pipeline.jsonl_writer

    def single_keeping_going(infer_request, request_config):
        try:
            return stock_single(infer_request, request_config)
        except Exception as exc:
            failure = media_failure(exc)
            if failure is None:
                raise  # not ours: the run ends as stock's does
            print(f"(no response: {failure})\n" + "-" * 50)
            pending.append(failure)
            return None

    class ErrorRecordsWriter:
        def __getattr__(self, name):
            return getattr(writer, name)

        def append(self, record, *args, **kwargs):
            if pending:
                _as_error_record(record, pending.pop(0))
            return writer.append(record, *args, **kwargs)

    vars(pipeline)["infer_single"] = single_keeping_going
    pipeline.jsonl_writer = ErrorRecordsWriter() if writer is not None else None
    try:
        records = stock(pipeline)
    finally:
        del vars(pipeline)["infer_single"]
        pipeline.jsonl_writer = writer
    for record in records:  # no result file: the records returned get theirs
        if pending and record.get("response") is None and "media_error" not in record:
            _as_error_record(record, pending.pop(0))
    return records


def metric_over_answered_rows(stock, pipeline):
    """``SwiftInfer._calc_metric`` (``--metric``): over the rows that were answered, the
    rows whose media failed left out (a ``null`` response is no answer to score, and
    ms-swift's rouge cannot read one); one line says how many."""
    import tempfile

    path = getattr(pipeline.jsonl_writer, "fpath", None)
    if not path or not os.path.exists(path):
        return stock(pipeline)
    with open(path) as results:
        lines = [line for line in results if line.strip()]
    answered = [line for line in lines if "media_error" not in json.loads(line)]
    if len(answered) == len(lines):
        return stock(pipeline)
    log.warning(f"swift_safe_media: --metric over the {len(answered)} rows answered; "
                f"{len(lines) - len(answered)} rows whose media failed are left out")
    writer = pipeline.jsonl_writer
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as scored:
        scored.writelines(answered)
        scored.flush()
        pipeline.jsonl_writer = type("AnsweredRows", (), {"fpath": scored.name})()
        try:
            return stock(pipeline)
        finally:
            pipeline.jsonl_writer = writer
