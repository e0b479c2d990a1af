"""ms-swift's commands beyond `swift sft`, for real, over clips that hang stock ms-swift (an HLS
playlist whose segment is a FIFO, a FIFO `.wav`), with the tiny Qwen2.5-Omni on CPU:

- `swift infer` over a dataset: every row answered, a failed row with an error record;
- `swift deploy`: concurrent HTTP clients on 127.0.0.1, a failed request gets a 400 naming
  the file, the others their answers, and the server goes on serving; a media URL on an
  internal address gets its 400 without a connection, unless the setting allows its host;
- `swift export --to_cached_dataset`: the bad rows left out, one warning each, counted;
- `swift rlhf --rlhf_type grpo`: a bad file in a rollout batch is replaced by a row chosen
  from the failed row itself (the same on every rank), and the batch keeps its size;
- the backends that do not install here, stubbed at the request boundary only.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("swift.template", reason="ms-swift is in requirements-test.txt")

from . import swift_scenario as scenario  # noqa: E402
from .fresh import ROOT, clean_environment, run_python  # noqa: E402
from .test_swift_e2e import free_port  # noqa: E402
from .test_serve_url_policy import media_server, no_connection  # noqa: E402
from .test_url_timeout import SLACK_S, _trickling_server, clip, warm  # noqa: E402,F401

RUN_TIMEOUT = 420
BAD = {"playlist.mp4": "HLS playlist refused", "fifo.wav": "not a regular file (FIFO)"}
MODEL = ["--model_type", "qwen2_5_omni", "--torch_dtype", "float32"]
TIMEOUT_S = 5
PROTECTED = ["--safe_media", "true", "--safe_media_timeout", str(TIMEOUT_S)]
TRAINING_WORDS = "takes another sample"
# While serving, media URLs on internal addresses are refused; the deploy test's media servers
# listen on 127.0.0.2, which the server is told to allow (127.0.0.1 stays refused).
MEDIA_HOST = "127.0.0.2"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return scenario.build(tmp_path_factory.mktemp("swift_inference"))


def bad_lines(log: str) -> dict[str, str]:
    """file name -> what the log says happens next, from our `skipped` lines."""
    return {os.path.basename(path): then for path, then in
            re.findall(r"swift_safe_media: skipped (\S+): .*? \(\w+, after [\d.]+ s\); (.*)", log)}


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_swift_infer_answers_every_row_and_gives_a_failed_one_an_error_record(built, tmp_path):
    """Batches of 4: the bad rows share their batch with good ones, which are answered."""
    result = tmp_path / "result.jsonl"
    args = ["--model", built["model"], *MODEL, "--val_dataset", built["dataset"], "--infer_backend", "transformers",
            "--max_batch_size", "4", "--max_new_tokens", "4", "--result_path", str(result), "--metric", "acc",
            *PROTECTED]
    code, elapsed, log = scenario.run_sft(args, command="infer", timeout=RUN_TIMEOUT, log_path=str(tmp_path / "log"))
    print(f"protected swift infer over {scenario.GOOD_CLIPS + 3} rows: {elapsed:.1f} s")
    assert code == 0, log[-4000:]
    given = [json.loads(line) for line in Path(built["dataset"]).read_text().splitlines()]
    records = [json.loads(line) for line in result.read_text().splitlines()]
    assert len(records) == len(given)
    for row, record in zip(given, records):
        media = (row.get("videos") or row.get("audios"))[0]
        assert (record.get("videos") or record.get("audios")) == [media]
        name = os.path.basename(media)
        if name in BAD:
            assert record["response"] is None
            assert record["media_error"] == {"file": media, "reason": BAD[name], "type": "MediaDecodeError"}
            assert record["messages"] == row["messages"][:1]  # the row's input, as it was given
            assert record["labels"] == row["messages"][1]["content"]
        else:
            assert isinstance(record["response"], str) and record["response"] and "media_error" not in record
    assert bad_lines(log) == dict.fromkeys(BAD, "its row is answered with an error record"), log[-4000:]
    assert TRAINING_WORDS not in log
    assert f"--metric over the {len(given) - len(BAD)} rows answered; {len(BAD)} rows whose media failed" in log
    assert re.search(r"\{'acc': [\d.]+\}", log), log[-2000:]
    folder = tmp_path / "result_safe_media"  # one per result file, as a training run's is
    written = json.loads((folder / "safe_media_summary.json").read_text())
    assert written["rows_failed"] == len(BAD) and written["error"] == len(BAD), written
    assert re.search(rf"swift_safe_media summary: .*; {len(BAD)} rows failed", log)
    assert sorted(os.path.basename(entry["path"]) for entry in
                  scenario.registry_entries(folder / "quarantine.jsonl")) == sorted(BAD)

    # --stream true: ms-swift asks row by row; a bad row gets its error record there too.
    rows = [row for row in given if os.path.basename((row.get("videos") or row.get("audios"))[0]) in BAD]
    rows.insert(1, given[0])
    streamed_rows = tmp_path / "streamed_rows.jsonl"
    streamed_rows.write_text("".join(json.dumps(row) + "\n" for row in rows))
    streamed = tmp_path / "streamed.jsonl"
    args = ["--model", built["model"], *MODEL, "--val_dataset", str(streamed_rows), "--infer_backend", "transformers",
            "--stream", "true", "--max_new_tokens", "4", "--result_path", str(streamed), *PROTECTED]
    code, elapsed, log = scenario.run_sft(args, command="infer", timeout=RUN_TIMEOUT, log_path=str(tmp_path / "log2"))
    print(f"protected swift infer --stream true over {len(rows)} rows: {elapsed:.1f} s")
    assert code == 0, log[-4000:]
    records = [json.loads(line) for line in streamed.read_text().splitlines()]
    assert [(record["response"] is None, record.get("media_error", {}).get("reason")) for record in records] == \
        [(name in BAD, BAD.get(name)) for name in
         (os.path.basename((row.get("videos") or row.get("audios"))[0]) for row in rows)], records
    assert all(record["messages"] == row["messages"][:1] for record, row in zip(records, rows) if record["response"] is None)
    assert json.loads((tmp_path / "streamed_safe_media" / "safe_media_summary.json").read_text())["rows_failed"] == len(BAD)


# --- swift deploy ---------------------------------------------------------------------------

def _chat(port: int, kind: str, media: str, stream: bool = False, timeout: float = 120):
    """(HTTP status, the JSON body or, for a stream, its `data:` events, seconds)."""
    content = [{"type": kind, kind: media}, {"type": "text", "text": "What is it?"}]
    body = json.dumps({"model": "tiny_qwen2_5_omni", "max_tokens": 4, "stream": stream,
                       "messages": [{"role": "user", "content": content}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            answer = re.findall(r"^data: (.*)$", text, re.M) if stream else json.loads(text)
            return response.status, answer, time.monotonic() - started
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), time.monotonic() - started


def _serving(port: int, server: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return True
        except OSError:
            time.sleep(1)
    return False


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_swift_deploy_answers_a_bad_request_with_400_and_goes_on_serving(built, tmp_path):
    """Concurrent clients, batches of 4: requests with bad media (a playlist, a URL that
    trickles) get their 400 within the timeout, the others their answers; then one more."""
    port = free_port()
    args = ["--model", built["model"], *MODEL, "--infer_backend", "transformers", "--max_batch_size", "4",
            "--max_new_tokens", "4", "--host", "127.0.0.1", "--port", str(port), *PROTECTED]
    log_path = tmp_path / "deploy.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen([scenario.SWIFT, "deploy", *args], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT,
                                  env=clean_environment({**scenario.RUN_ENV,
                                                         "SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS": MEDIA_HOST}))
    try:
        assert _serving(port, server, RUN_TIMEOUT), log_path.read_text()[-4000:]
        # A media server that trickles a clip's bytes over two minutes: stock ms-swift's download
        # (a timeout per network operation) holds the request, and the server's event loop, for all of it.
        trickle, url = _trickling_server(Path(built["good_0.mp4"]).read_bytes(), 120, MEDIA_HOST)
        requests = [("video", built["good_0.mp4"]), ("video", built["playlist.mp4"]), ("video", built["good_1.mp4"]),
                    ("video", url), ("video", built["good_2.mp4"]), ("video", built["playlist.mp4"])]
        with concurrent.futures.ThreadPoolExecutor(len(requests)) as clients:
            answers = list(clients.map(lambda request: _chat(port, *request), requests))
        trickle.shutdown()
        for (_, media), (status, body, elapsed) in zip(requests, answers):
            if media == url:
                assert status == 400 and body["file"] == url and body["type"] == "MediaDecodeTimeout", body
                assert "overran its 5 s timeout" in body["reason"] and elapsed < 60, (body, elapsed)  # batched with 5 others
            elif os.path.basename(media) == "playlist.mp4":
                # ms-swift sends a local file to the model as a data: URI, which is what the decoder sees.
                assert status == 400, body
                assert body["reason"] == BAD["playlist.mp4"] and body["file"].startswith("<data: URI"), body
                assert body["object"] == "error" and body["type"] in ("MediaDecodeError", "MediaQuarantined")
                assert elapsed < 60
            else:
                assert status == 200, body
                assert body["choices"][0]["message"]["content"]
        status, body, _ = _chat(port, "video", built["good_3.mp4"])  # still serving
        assert status == 200, body
        _a_trickling_url_holds_only_its_own_request(port, built)
        _internal_media_urls_are_refused_unless_allowed(port, built)
        # Streamed: the 400 comes before the stream would begin; a good stream is as stock's.
        status, body, _ = _chat(port, "video", built["playlist.mp4"], stream=True)
        assert status == 400 and body["reason"] == BAD["playlist.mp4"], body
        status, events, _ = _chat(port, "video", built["good_3.mp4"], stream=True)
        assert status == 200 and events[-1] == "[DONE]" and len(events) > 1, events
        assert server.poll() is None
        log = log_path.read_text(errors="replace")
        assert "its request is answered with HTTP 400" in log and TRAINING_WORDS not in log
        assert re.search(r"swift_safe_media: refused http://127\.0\.0\.1:\d+/clip\.mp4: resolves to 127\.0\.0\.1, "
                         r"a loopback address; .*its request is answered with HTTP 400", log), log[-4000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _a_trickling_url_holds_only_its_own_request(port: int, built):
    """While a URL trickles (ms-swift downloads media URLs in the server's event loop), the
    server answers the others; the URL's 400 comes at its timeout (download and decode
    share one), not later."""
    trickle, url = _trickling_server(Path(built["good_0.mp4"]).read_bytes(), 120, MEDIA_HOST)
    done = {}

    def timed(name, call):
        result = call()
        done[name] = time.monotonic()
        return result

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as clients:
            slow = clients.submit(timed, "url", lambda: _chat(port, "video", url))
            time.sleep(1)  # the URL's download is under way
            listed = clients.submit(timed, "models", lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{port}/v1/models", timeout=60).status)
            good = clients.submit(timed, "good", lambda: _chat(port, "video", built["good_1.mp4"]))
            (status, body, elapsed), answer = slow.result(), good.result()
    finally:
        trickle.shutdown()
    print(f"trickling URL: 400 after {elapsed:.1f} s; /v1/models and a good request answered "
          f"{done['url'] - done['models']:.1f} s and {done['url'] - done['good']:.1f} s before it")
    assert status == 400 and body["type"] == "MediaDecodeTimeout" and body["file"] == url, body
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed  # one timeout, not the download's and then the decode's
    assert listed.result() == 200 and answer[0] == 200, answer
    assert done["models"] < done["url"] and done["good"] < done["url"], done  # answered while it trickled


def _internal_media_urls_are_refused_unless_allowed(port: int, built):
    """Media URLs on internal addresses (issue 42): 127.0.0.1 and the metadata endpoint are
    refused with a 400 naming the URL and why, before any connection (image, audio and video
    alike), a redirect from the allowed host to 127.0.0.1 too; the allowed host's clip decodes."""
    clip_bytes = Path(built["good_0.mp4"]).read_bytes()
    internal, internal_url, reached = media_server("127.0.0.1", clip_bytes)
    allowed, allowed_url, served = media_server(MEDIA_HOST, clip_bytes)
    bouncer, bouncer_url, _ = media_server(MEDIA_HOST, redirect=f"{internal_url}/clip.mp4")
    try:
        for kind in ("video", "image_url", "audio"):
            status, body, _ = _chat(port, kind, f"{internal_url}/clip.mp4")
            assert status == 400 and body["file"] == f"{internal_url}/clip.mp4", body
            assert body["reason"] == ("resolves to 127.0.0.1, a loopback address; internal addresses are refused "
                                      "when serving (SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS)"), body
        status, body, _ = _chat(port, "image_url", "http://169.254.169.254/latest/meta-data/iam/")
        assert status == 400 and body["file"] == "http://169.254.169.254/latest/meta-data/iam/", body
        assert "169.254.169.254, a link-local address (a cloud metadata endpoint)" in body["reason"], body
        status, body, _ = _chat(port, "video", f"{bouncer_url}/clip.mp4")
        assert status == 400 and body["file"] == f"{bouncer_url}/clip.mp4", body
        assert body["reason"].startswith(f"redirected to {internal_url}/clip.mp4, which resolves to 127.0.0.1, "
                                         "a loopback address"), body
        assert no_connection(reached), reached
        status, body, _ = _chat(port, "video", f"{allowed_url}/clip.mp4")  # the host the setting allows
        assert status == 200 and body["choices"][0]["message"]["content"], body
        assert ("/clip.mp4", allowed_url.removeprefix("http://")) in served
    finally:
        for server in (internal, allowed, bouncer):
            server.shutdown()


def test_a_downloaded_url_and_its_decode_share_one_timeout(clip, warm, monkeypatch, tmp_path):
    """ms-swift's own `_materialize_media` (which downloads a request's media URL and writes
    it to a file) through the deploy patches: the decode of that file gets what the download
    left of the timeout, and names the URL. A URL that takes 60% of the timeout to arrive,
    then a decode that would take a minute: the whole ends at one timeout."""
    from swift.pipelines.infer.deploy import SwiftDeploy
    from swift.utils.url_utils import SafeUrlFetcher

    from swift_safe_media import MediaDecodeTimeout
    from swift_safe_media.engine import calls as engine
    from swift_safe_media.decoders import guards, inputs
    from swift_safe_media.hosts.swift import inference as swift_inference, serving as swift_serving

    from . import sandboxed
    from .test_url_timeout import TIMEOUT_S as timeout

    monkeypatch.setattr(swift_inference.MODE, "name", "deploy")
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_SERVE_ALLOW_HOSTS", "127.0.0.1")  # ms-swift's own check follows it
    stock_read = SafeUrlFetcher.read
    monkeypatch.setattr(SafeUrlFetcher, "read", classmethod(
        lambda fetcher, url, **kwargs: swift_serving.read_url_within_timeout(stock_read, fetcher, url, **kwargs)))
    server, url = _trickling_server(clip, seconds=timeout * 0.6)
    try:
        started = time.monotonic()
        path = swift_serving.file_named_with_its_download(SwiftDeploy._materialize_media, url, "video", str(tmp_path))
        source = inputs.fetched(inputs.describe(path), guards.Limits.from_env(), None)
        assert Path(path).read_bytes() == clip and source.label == url and source.timeout == timeout, source
        assert source.deadline - time.monotonic() < timeout * 0.5  # what the download left, no new timeout
        with pytest.raises(MediaDecodeTimeout) as caught:
            engine.call(sandboxed.sleep_then_return, 60, source, path=source.label)
        elapsed = time.monotonic() - started
    finally:
        server.shutdown()
    assert caught.value.path == url
    assert f"the download and the decode together overran their {timeout:g} s timeout" in str(caught.value)
    assert elapsed < timeout + SLACK_S, elapsed


# --- swift export --to_cached_dataset --------------------------------------------------------

@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_swift_export_to_cached_dataset_leaves_the_bad_rows_out(built, tmp_path):
    out = tmp_path / "cached"
    args = ["--model", built["model"], *MODEL, "--dataset", built["dataset"], "--to_cached_dataset", "true",
            "--split_dataset_ratio", "0", "--dataset_num_proc", "1", "--output_dir", str(out), *PROTECTED]
    code, elapsed, log = scenario.run_sft(args, command="export", timeout=RUN_TIMEOUT, log_path=str(tmp_path / "log"))
    print(f"protected swift export --to_cached_dataset: {elapsed:.1f} s")
    assert code == 0, log[-4000:]
    import datasets

    cached = datasets.load_from_disk(str(out / "train"))
    assert len(cached) == scenario.GOOD_CLIPS + 1  # the edit-list clip is good data
    assert bad_lines(log) == dict.fromkeys(BAD, "ms-swift leaves the row out"), log[-4000:]
    assert sum(log.count(f"swift_safe_media: skipped {built[name]}") for name in BAD) == len(BAD)
    written = json.loads((out / "safe_media" / "safe_media_summary.json").read_text())
    assert written["rows_failed"] == 0 and written["error"] == len(BAD), written  # ms-swift's map counts rows
    assert TRAINING_WORDS not in log


# --- swift rlhf --rlhf_type grpo -------------------------------------------------------------

@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_grpo_rollouts_replace_a_row_whose_media_fail(built, tmp_path):
    """Six prompts, two of them bad, `num_generations 2`, 2 completions per step: each bad row
    is checked before the rollout and replaced, every copy of it by the same row (chosen from
    the failed row itself, so alike on every rank), so the epoch keeps its 6 steps, each
    scores one prompt's 2 completions, and no bad file reaches the reward function.
    (One rank: ms-swift 4.6.0's GRPO on two CPU ranks with gloo fails its own
    `len(local_advantages) == len(samples)` check at the first step, over good clips too.)"""
    clips = {name: built[name] for name in ("good_0.mp4", "playlist.mp4", "good_1.mp4", "fifo.wav", "good_2.mp4",
                                            "good_3.mp4")}
    rows = []
    for name, path in clips.items():
        kind = "audios" if name.endswith(".wav") else "videos"
        tag = "<audio>What do you hear?" if kind == "audios" else "<video>What do you see?"
        rows.append({"messages": [{"role": "user", "content": tag}], kind: [path]})
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = tmp_path / "seen.jsonl"
    args = ["--rlhf_type", "grpo", "--model", built["model"], *MODEL, "--dataset", str(dataset),
            "--external_plugins", os.path.join(ROOT, "tests", "grpo_reward.py"), "--reward_funcs", "media_seen",
            "--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", "4",
            "--tuner_type", "lora", "--num_train_epochs", "1", "--dataloader_num_workers", "0",
            "--save_strategy", "no", "--report_to", "none", "--logging_steps", "1", "--max_length", "4096",
            "--output_dir", str(tmp_path / "out"), "--split_dataset_ratio", "0", "--check_model", "false",
            *PROTECTED]
    code, elapsed, log = scenario.run_sft(args, command="rlhf", timeout=RUN_TIMEOUT, log_path=str(tmp_path / "log"),
                                          env={"GRPO_SEEN_LOG": str(seen)})
    print(f"protected swift rlhf grpo: {elapsed:.1f} s")
    assert code == 0, log[-4000:]
    assert scenario.steps(log) == (len(rows), len(rows)), log[-4000:]
    scored = [json.loads(line)["media"] for line in seen.read_text().splitlines()]
    assert len(scored) == 2 * len(rows)
    assert all(scored[index] == scored[index + 1] for index in range(0, len(scored), 2)), scored  # one prompt
    assert not {os.path.basename(media) for entry in scored for media in entry} & set(BAD), scored
    assert bad_lines(log) == dict.fromkeys(BAD, "the rollout takes another row in its place"), log[-4000:]
    replaced = re.findall(r"swift_safe_media: rollout row with (\S+) replaced by dataset row (\d+)", log)
    assert sorted(os.path.basename(path) for path, _ in replaced) == sorted(BAD), replaced  # once per file
    written = json.loads((scenario.run_folder(str(tmp_path / "out")) / "safe_media_summary.json").read_text())
    assert written["rows_failed"] == 2 * len(BAD), written  # both copies of each bad prompt
    assert TRAINING_WORDS not in log


def test_the_other_backends_answer_every_row_too(built):
    """vLLM (with and without its async engine), SGLang and LMDeploy, stubbed at the request
    boundary only (tests/stub_engines.py), through ms-swift's own `_batch_infer`."""
    done = run_python(module="tests.stub_engines", args=[built["model"], built["dataset"]],
                      env=clean_environment(scenario.RUN_ENV), timeout=300)
    results = json.loads(done.stdout.split("RESULTS ", 1)[1])
    assert set(results) == {"vllm", "vllm_async", "sglang", "lmdeploy"}
    for backend, records in results.items():
        failed = {os.path.basename(record["media_error"]["file"]): record["media_error"]["reason"]
                  for record in records if record["response"] is None}
        assert failed == BAD, (backend, records)
        answered = [record["response"] for record in records if record["response"] is not None]
        assert len(answered) == len(records) - len(BAD) and all(text.endswith(" prompt tokens") for text in answered)


def test_a_failed_rollout_row_gets_the_same_replacement_on_every_rank():
    """What the real GRPO run above cannot show on one rank: two ranks that have seen
    different rows before choose the same replacement for the same failed row, every copy
    of it, and keep their batch's size. (A template stand-in that fails rows naming a bad
    file; the real template is exercised by the real run.)"""
    import types

    from swift_safe_media.errors import MediaDecodeError
    from swift_safe_media.hosts.swift import rollouts as swift_rollouts

    def encode(row, *args, **kwargs):
        for media in swift_rollouts.media_of(row):
            if "bad" in media:
                raise MediaDecodeError(media, "refused")
        return {"input_ids": [1]}

    dataset = [{"messages": [{"role": "user", "content": "<video>?"}], "videos": [f"/data/{name}.mp4"]}
               for name in ("a", "bad_b", "c", "d", "bad_e", "f", "g", "h")]
    trainer = types.SimpleNamespace(template=types.SimpleNamespace(encode=encode), train_dataset=dataset,
                                    eval_dataset=None, model=types.SimpleNamespace(training=True))
    chosen = []
    for history in ([], dataset[5:]):  # rank 1 has already seen f, g, h decode
        swift_rollouts._Checked.good_media, swift_rollouts._Checked.replacements = set(), {}
        for row in history:
            swift_rollouts._row_that_decodes(trainer, row)
        batch = [dataset[1], dataset[1], dataset[0], dataset[4]]
        done = swift_rollouts.rollout_with_media_checked(lambda trainer, rows: rows, trainer, batch)
        assert len(done) == len(batch) and done[0] == done[1] and done[2] == dataset[0]
        assert not any("bad" in media for row in done for media in swift_rollouts.media_of(row))
        chosen.append(done)
    assert chosen[0] == chosen[1]
    swift_rollouts._Checked.good_media, swift_rollouts._Checked.replacements = set(), {}
