"""A URL gets one timeout for its download and its decode together (issue 26): a real
HTTP server on 127.0.0.1 trickles the bytes; the download runs in an unconfined sandbox,
the decode in a confined one, and both end by the deadline the download started.
The servers stop by themselves (each response ends within a minute)."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from swift_safe_media import MediaDecodeTimeout
from swift_safe_media.engine import calls as engine
from swift_safe_media.decoders import guards, inputs
from swift_safe_media.decoders import swift as safe

from . import sandboxed
from .damaged_media import ffmpeg, video_src
from .fresh import ROOT, clean_environment, run_python

TIMEOUT_S = 4.0
SLACK_S = 2.0  # a busy 2-core box: killing and reporting, never another timeout's worth


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("url_timeout") / "clip.mp4"
    ffmpeg(*video_src(1, size="64x48", rate=10), "-pix_fmt", "yuv420p", str(path))
    return path.read_bytes()


def _trickling_server(body: bytes, seconds: float, host: str = "127.0.0.1"):
    """Serves ``body`` spread evenly over ``seconds`` (stops writing after a minute), on
    ``host`` (a loopback address: serving allows only the one it is told to)."""

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            pause, stop = seconds / len(body), time.monotonic() + 60
            try:
                for offset in range(len(body)):
                    self.wfile.write(body[offset:offset + 1])
                    self.wfile.flush()
                    time.sleep(pause)
                    if time.monotonic() > stop:
                        return
            except OSError:  # the sandbox that read it was killed
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((host, 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/clip.mp4"


@pytest.fixture
def warm(monkeypatch):
    """Sandboxes of both kinds started, as in a run past its first sample: their start-up
    is never counted in a timeout."""
    monkeypatch.setenv("SWIFT_SAFE_MEDIA_TIMEOUT", str(TIMEOUT_S))
    engine.call(len, "warm")
    engine.call(len, "warm", confine=False)


def test_the_decode_gets_what_the_download_left_of_the_timeout(clip, warm):
    server, url = _trickling_server(clip, seconds=TIMEOUT_S * 0.6)
    try:
        started = time.monotonic()
        source = inputs.fetched(inputs.describe(url), guards.Limits.from_env(), None)
        downloaded = time.monotonic() - started
        assert source.kind == "bytes" and source.value == clip
        assert TIMEOUT_S * 0.5 < downloaded < TIMEOUT_S, downloaded
        # what the engine left the decode: its clock starts when the download runs (a sandbox's
        # start is not counted), so under load this is more than the test's wall clock leaves
        left = source.deadline - time.monotonic()
        assert 0 < left < TIMEOUT_S * 0.5, left  # the 2.4 s download was counted
        with pytest.raises(MediaDecodeTimeout) as caught:  # a decode slower than what is left
            engine.call(sandboxed.sleep_then_return, 60, source, path=source.label)
        elapsed = time.monotonic() - started
    finally:
        server.shutdown()
    assert url in str(caught.value)
    assert f"the download and the decode together overran their {TIMEOUT_S:g} s timeout" in str(caught.value)
    assert caught.value.elapsed < left + SLACK_S / 2, (caught.value.elapsed, left)
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed  # not the download's time plus a whole timeout


def test_a_one_byte_a_second_source_ends_at_its_timeout(clip, warm):
    server, url = _trickling_server(clip, seconds=len(clip))  # one byte a second
    try:
        started = time.monotonic()
        with pytest.raises(MediaDecodeTimeout) as caught:
            safe.load_video_llava(url)
        elapsed = time.monotonic() - started
    finally:
        server.shutdown()
    assert url in str(caught.value)
    assert elapsed < TIMEOUT_S + SLACK_S, elapsed


def test_a_fast_url_decodes_as_the_file_does(clip, warm, tmp_path):
    server, url = _trickling_server(clip, seconds=0.2)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    try:
        frames = safe.load_video_llava(url)
    finally:
        server.shutdown()
    assert [frame.tolist() for frame in frames] == [frame.tolist() for frame in safe.load_video_llava(str(path))]


DOWNLOAD_SANDBOX = """
import json, os
import swift_safe_media
from swift_safe_media import call, process
swift_safe_media.enable(hosts=[])
zygote = process.current().shared_zygote
zygote.ready.wait(120)
print(json.dumps({"zygote": zygote.pid, "confined": call(os.getppid), "unconfined": call(os.getppid, confine=False)}))
"""


@pytest.mark.timeout(240)
def test_a_download_sandbox_comes_from_the_ranks_shared_zygote():
    """No second zygote to start (seconds, a few hundred MB) in each process that meets a URL."""
    done = run_python(code=DOWNLOAD_SANDBOX, env=clean_environment(warm_start=True, pythonpath=[ROOT]), timeout=200)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["zygote"] and found["confined"] == found["unconfined"] == found["zygote"], found
