"""Real-world media for the parity suite: files other projects ship as test assets
(tests/data/, listed with source and licence in tests/data/README.md), and the cases the
issue names, made with ffmpeg at test time where no shipped file shows them.

Stock loaders run in child interpreters, one case at a time with a per-case deadline:
decord hangs on some files (the last frame of an MPEG-1 stream), and a case that hangs is
recorded as such, its child killed, and a new child goes on with the next case.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
FFMPEG = os.environ.get("FFMPEG", "ffmpeg")

# Files of other projects (tests/data/README.md): name -> kind.
SHIPPED_VIDEO = ["bikes.mp4", "carphone_distorted.mp4", "bigbuckbunny.mp4", "Megamind.avi", "tree.avi",
                 "h265_video.mp4", "testsrc2_odd_height_vp9.mp4", "nasa_13013_rotated.mp4", "testsrc2_av1_10bit.mp4",
                 "discard_first_keyframe.mp4"]
SHIPPED_AUDIO = ["test-44100Hz-be-1ch-4bytes.wav", "test-44100Hz-2ch-32bit-float-le.wav",
                 "test-44100Hz-2ch-32bit-float-be.wav", "test-48000Hz-2ch-64bit-float-le-wavex.wav",
                 "test-8000Hz-le-2ch-1byteu.wav", "test-8000Hz-le-1ch-1byte-ulaw.wav",
                 "test-8000Hz-le-3ch-5S-24bit.wav", "test-44100Hz-le-1ch-4bytes-rf64.wav",
                 "test-1234Hz-le-1ch-10S-20bit-extra.wav", "test-44100Hz-le-1ch-4bytes-early-eof.wav",
                 "bell.oga", "silence-44-s-mpeg25.mp3", "lame.mp3", "alac.m4a", "example.opus", "silence-44-s.ac3",
                 "silence-44-s.wv", "silence-1.wma", "11k-1ch-2s-silence.aif", "variable-block.flac", "click.mpc",
                 "sine_mono_mp3.swf", "silence-3.wma", "silence-44-s.tak", "silence-44-s.eac3", "multiplexed.spx",
                 "silence-2s-PCM-16000-08-ID3v23.wav", "no-tags.3g2", "with-id3.aif", "5644800-2ch-s01-silence.dsf",
                 "mac-399.ape", "cards-001.wav", "sense_and_sensibility_01_austen_64kb-0880.wav", "vm-received.g722",
                 "hello-world.gsm", "Rear_Left.wav", "percussion-10.wav"]

_SRC = ["-f", "lavfi", "-i", "testsrc2=size=160x96:rate=25:duration=1.2"]
_X264 = ["-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p"]
_TONE0 = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=16000:duration=1"]
_TONE1 = ["-f", "lavfi", "-i", "aevalsrc=0.3*sin(2*PI*880*t)|0.3*sin(2*PI*660*t):s=16000:d=1"]

# The cases the issue names, as ffmpeg makes them: name -> argument lists, run in order
# (a later one may read what an earlier one wrote, by name, in the same folder).
SYNTHESIZED = {
    # A palette handed over once, on the first packet (AVI strf / MOV stsd).
    "pal8_rawvideo.avi": [[*_SRC, "-c:v", "rawvideo", "-pix_fmt", "pal8", "{out}"]],
    "pal8_qtrle_gray.mov": [[*_SRC, "-c:v", "qtrle", "-pix_fmt", "gray", "{out}"]],
    "mpeg2_video.m2v": [[*_SRC, "-c:v", "mpeg2video", "-f", "mpeg2video", "{out}"]],
    "mpeg1_video.m1v": [[*_SRC, "-c:v", "mpeg1video", "-f", "mpeg1video", "{out}"]],
    "h264_annexb.h264": [[*_SRC, *_X264, "-f", "h264", "{out}"]],
    "hevc_annexb.hevc": [[*_SRC, "-c:v", "libx265", "-x265-params", "log-level=error", "-f", "hevc", "{out}"]],
    "h264_m2ts.m2ts": [[*_SRC, *_X264, "-f", "mpegts", "-mpegts_m2ts_mode", "1", "{out}"]],
    "mpeg2_program.mpg": [[*_SRC, "-c:v", "mpeg2video", "-f", "mpeg", "{out}"]],
    # A stream-copy cut whose first keyframe is flagged for discard, with a later keyframe.
    "discarded_keyframe.mp4": [
        ["-f", "lavfi", "-i", "testsrc2=size=160x96:rate=25:duration=4", *_X264, "-bf", "0", "-g", "25",
         "-keyint_min", "25", "-sc_threshold", "0", "{dir}/_gop25.mp4"],
        ["-ss", "1.2", "-i", "{dir}/_gop25.mp4", "-t", "1", "-c", "copy", "{out}"]],
    # Two video streams: the first has the higher bit rate, the second the default flag.
    "two_video_streams.mp4": [[*_SRC, "-f", "lavfi", "-i", "testsrc=size=96x64:rate=25:duration=1.2", "-map", "0",
                               "-map", "1", *_X264, "-disposition:v:0", "0", "-disposition:v:1", "default", "{out}"]],
    # Two audio tracks: mono first, stereo second with the default flag.
    "two_audio_tracks.mp4": [[*_TONE0, *_TONE1, "-map", "0", "-map", "1", "-c:a", "aac", "-disposition:a:0", "0",
                              "-disposition:a:1", "default", "{out}"]],
    "rotated_90.mp4": [[*_SRC, *_X264, "{dir}/_plain.mp4"],
                       ["-i", "{dir}/_plain.mp4", "-c", "copy", "-metadata:s:v:0", "rotate=90", "{out}"]],
    "hevc_10bit.mp4": [[*_SRC, "-c:v", "libx265", "-pix_fmt", "yuv420p10le", "-x265-params", "log-level=error",
                        "{out}"]],
    # Field-coded 1080i-style MPEG-TS: 62 field packets, 31 frames (tests/paff.py writes the H.264).
    "interlaced_fields.ts": [["-f", "h264", "-i", "{dir}/_fields.264", "-c", "copy", "-bsf:v",
                              "setts=ts=N*1501:duration=1501", "-f", "mpegts", "{out}"]],
    "wav_16ch.wav": [["-f", "lavfi", "-i", "sine=frequency=300:sample_rate=16000:duration=0.5", "-af",
                      "pan=hexadecagonal|" + "|".join(f"c{i}=c0" for i in range(16)), "-c:a", "pcm_s16le",
                      "{out}"]],
    "flac_192k.flac": [["-f", "lavfi", "-i", "sine=frequency=1000:sample_rate=192000:duration=0.5", "-c:a", "flac",
                        "{out}"]],
}
# Codecs and containers the 60 files span that no shipped file shows (QCIF: H.263
# takes no other size); each in the container its users meet it in.
_QCIF = ["-f", "lavfi", "-i", "testsrc2=size=176x144:rate=25:duration=1.2"]
SYNTHESIZED.update({
    "vp8.webm": [[*_QCIF, "-c:v", "libvpx", "-b:v", "300k", "-deadline", "realtime", "{out}"]],
    "av1.mp4": [[*_QCIF, "-c:v", "libsvtav1", "-preset", "12", "{out}"]],
    "mpeg4_bframes.avi": [[*_QCIF, "-c:v", "mpeg4", "-bf", "2", "-q:v", "5", "{out}"]],
    "h263.3gp": [[*_QCIF, "-c:v", "h263", "-q:v", "5", "{out}"]],
    "flv1.flv": [[*_QCIF, "-c:v", "flv", "-q:v", "5", "{out}"]],
    "mjpeg.avi": [[*_QCIF, "-c:v", "mjpeg", "-pix_fmt", "yuvj420p", "-q:v", "5", "{out}"]],
    "wmv2.wmv": [[*_QCIF, "-c:v", "wmv2", "-q:v", "5", "{out}"]],
    "h264_444.mp4": [[*_QCIF, "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv444p", "{out}"]],
    "h264_10bit.mp4": [[*_QCIF, "-c:v", "libx264", "-preset", "ultrafast", "-pix_fmt", "yuv420p10le", "{out}"]],
    # Variable frame rate, as phones record: 25 fps for 15 frames, then 12.5.
    "h264_vfr.mp4": [[*_QCIF, "-vf", "setpts='N/25/TB+if(gte(N,15),0.04*(N-15)/TB,0)'", "-fps_mode", "passthrough",
                      *_X264, "{out}"]],
    "mpeg2_ts.ts": [[*_QCIF, "-c:v", "mpeg2video", "-f", "mpegts", "{out}"]],
    "prores.mov": [[*_QCIF, "-c:v", "prores_ks", "-profile:v", "0", "{out}"]],
    # H.264 with B-frames in AVI, which stores no presentation times.
    "h264_bframes.avi": [["-f", "lavfi", "-i", "testsrc2=size=176x144:rate=25:duration=2", "-c:v", "libx264",
                          "-bf", "2", "-pix_fmt", "yuv420p", "{out}"]],
    # Cover art (an attached picture) as a second video stream, as downloaders write it.
    "cover_art.mp4": [["-f", "lavfi", "-i", "testsrc2=size=64x64:rate=1:duration=1", "-frames:v", "1",
                       "{dir}/_cover.jpg"],
                      [*_QCIF, "-i", "{dir}/_cover.jpg", "-map", "0", "-map", "1", "-c:v:0", "libx264", "-pix_fmt",
                       "yuv420p", "-c:v:1", "mjpeg", "-disposition:v:1", "attached_pic", "{out}"]],
})
# The formats issue 34 names, as ffmpeg writes them (speech at 16 kHz, as corpora ship it).
_SPEECH = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=16000:duration=1.5"]
_LONG = ["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=44100:duration=20"]
SYNTHESIZED_SPEECH = {
    # ALAC in Matroska, 41 kHz stereo: torchcodec drops the first frame.
    "alac.mka": [["-f", "lavfi", "-i", "aevalsrc=0.3*sin(2*PI*440*t)|0.3*sin(2*PI*660*t):s=41000:d=4.8",
                  "-c:a", "alac", "{out}"]],
    "gsm_610.wav": [["-f", "lavfi", "-i", "sine=frequency=440:sample_rate=8000:duration=1.5", "-c:a", "libgsm_ms",
                     "{out}"]],
    "speex.spx": [[*_SPEECH, "-c:a", "libspeex", "{out}"]],
    "raw.g722": [[*_SPEECH, "-c:a", "g722", "-f", "g722", "{out}"]],
    "bext_first.bwf": [[*_SPEECH, "-write_bext", "1", "-f", "wav", "{out}"]],
    # The same, its data size left at 0 by a recorder that never came back to it (``_unsized``).
    "bext_unsized.bwf": [[*_SPEECH, "-write_bext", "1", "-f", "wav", "{out}"]],
    "id3_tagged.aac": [[*_SPEECH, "-c:a", "aac", "-f", "adts", "-write_id3v2", "1", "-metadata", "title=x", "{out}"]],
    "speech.voc": [[*_SPEECH, "-f", "voc", "{out}"]],
    "speech.au": [[*_SPEECH, "-f", "au", "{out}"]],
    "speech.tta": [[*_SPEECH, "-f", "tta", "{out}"]],
    # 100 kB of junk, then 20 s of MP3 / ADTS (``_junk_before``).
    "junk_then.mp3": [[*_LONG, "-c:a", "libmp3lame", "{dir}/_long.mp3"]],
    "junk_then.aac": [[*_LONG, "-c:a", "aac", "-f", "adts", "{dir}/_long.aac"]],
    # 1 s of MP3 behind the junk: FFmpeg's probe finds it only with the file's name.
    "junk_then_short.mp3": [[*_SPEECH, "-c:a", "libmp3lame", "{dir}/_short.mp3"]],
}
SYNTHESIZED.update(SYNTHESIZED_SPEECH)
SYNTHESIZED["animated.gif"] = [["-f", "lavfi", "-i", "testsrc2=size=96x64:rate=10:duration=1.2", "-f", "gif",
                                "{out}"]]
SYNTHESIZED_VIDEO = [name for name in SYNTHESIZED if name not in ("two_audio_tracks.mp4", "wav_16ch.wav",
                                                                   "flac_192k.flac", *SYNTHESIZED_SPEECH)]
SYNTHESIZED_AUDIO = ["two_audio_tracks.mp4", "wav_16ch.wav", "flac_192k.flac", "amr_nb.amr", *SYNTHESIZED_SPEECH,
                     "amr_wb.awb", "speech.sph", "voice_memo.qcp"]



def _write_amr(path: Path) -> None:
    """AMR-NB in its storage format (RFC 4867: "#!AMR\n", then frames of 12.2 kbit/s:
    a header byte and 31 bytes). FFmpeg has no AMR encoder here; the decoder decodes any
    bits, so seeded random frames make a valid two-second file (low bits only: loud noise
    would clip in stock's 16-bit pipe)."""
    import random

    rng = random.Random(26)
    path.write_bytes(b"#!AMR\n" + b"".join(b"\x3c" + bytes(rng.getrandbits(8) & 0x0F for _ in range(31))
                                            for _ in range(100)))


def _write_amr_wb(path: Path) -> None:
    """AMR-WB in its storage format ("#!AMR-WB\n", then 12.65 kbit/s frames: a header byte
    and 32 bytes), as ``_write_amr``: FFmpeg has no AMR-WB encoder here."""
    import random

    rng = random.Random(34)
    path.write_bytes(b"#!AMR-WB\n" + b"".join(b"\x14" + bytes(rng.getrandbits(8) & 0x0F for _ in range(32))
                                               for _ in range(75)))


def sphere(pcm: bytes, rate: int = 16000) -> bytes:
    """NIST SPHERE as speech corpora (TIMIT, Switchboard) ship it: the 1024-byte text header
    of typed fields the spec defines, then 16-bit little-endian PCM. ffmpeg has no muxer."""
    header = (f"NIST_1A\n   1024\nsample_count -i {len(pcm) // 2}\nsample_rate -i {rate}\nchannel_count -i 1\n"
              "sample_n_bytes -i 2\nsample_byte_format -s2 01\nsample_coding -s3 pcm\nend_head\n").encode()
    return header.ljust(1024, b" ") + pcm


def qcp(packets: bytes = b"") -> bytes:
    """Qualcomm PureVoice (phone voice memos): RIFF 'QLCM', the 150-byte fmt chunk naming
    QCELP-13K by GUID (RFC 3625), a vrat chunk, then the packets. ffmpeg has no muxer."""
    import struct
    import uuid

    guid = uuid.UUID("5e7f6d41-b115-11d0-ba91-00805fb4b97e").bytes_le
    rates = bytes([34, 4, 16, 3, 7, 2, 3, 1, 0, 0]).ljust(16, b"\0")  # (packet size, rate) pairs
    fmt = struct.pack("<BB16sH80sHHHHHI16s20s", 1, 0, guid, 1, b"Qcelp 13K".ljust(80, b"\0"), 14000, 35, 160,
                      8000, 16, 5, rates, bytes(20))
    body = b"QLCM" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"vrat" + struct.pack("<III", 8, 1, 0) + \
        b"data" + struct.pack("<I", len(packets)) + packets
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _write_sphere(path: Path) -> None:
    path.write_bytes(sphere(subprocess.run([FFMPEG, "-nostdin", "-v", "error", *_SPEECH, "-f", "s16le", "-"],
                                           check=True, capture_output=True, timeout=60).stdout))


def _write_qcp(path: Path) -> None:
    """Two seconds of full-rate QCELP packets (a rate byte, 34 bytes of seeded low bits, as
    ``_write_amr``): FFmpeg has no QCELP encoder, its decoder decodes any bits."""
    import random

    rng = random.Random(5)
    path.write_bytes(qcp(b"".join(b"\x04" + bytes(rng.getrandbits(8) & 0x0F for _ in range(34)) for _ in range(100))))


def _unsized(path: Path) -> None:
    """Zero the WAV's data chunk size, as a recorder that never came back to it leaves it."""
    data = bytearray(path.read_bytes())
    at = data.find(b"data")
    data[at + 4:at + 8] = bytes(4)
    path.write_bytes(bytes(data))


def junk(length: int = 100 * 1024) -> bytes:
    """Seeded bytes without 0xFF: nothing an MPEG audio or ADTS sync could start."""
    import random

    return bytes(b if b != 0xFF else 0x7F for b in random.Random(34).randbytes(length))


def synthesize(directory) -> dict[str, str]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_amr(directory / "amr_nb.amr")
    _write_amr_wb(directory / "amr_wb.awb")
    _write_sphere(directory / "speech.sph")
    _write_qcp(directory / "voice_memo.qcp")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import paff

    (directory / "_fields.264").write_bytes(paff.paff())
    made = {name: str(directory / name) for name in ("amr_nb.amr", "amr_wb.awb", "speech.sph", "voice_memo.qcp")}
    for name, steps in SYNTHESIZED.items():
        out = directory / name
        for args in steps:
            args = [a.replace("{out}", str(out)).replace("{dir}", str(directory)) for a in args]
            subprocess.run([FFMPEG, "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *args], check=True,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        if name.startswith("junk_then"):  # ffmpeg wrote the stream beside it: junk first
            beside = "_short" if "short" in name else "_long"
            out.write_bytes(junk() + (directory / f"{beside}{out.suffix}").read_bytes())
        if name == "bext_unsized.bwf":
            _unsized(out)
        made[name] = str(out)
    return made


# --- the loaders, stock or twin, reduced to (array, metadata) ------------------------------

VIDEO_CASES = {  # case -> (function, kwargs); qwen is fetch_video
    "internvl": ("load_video_internvl", {"num_segments": 8}),
    "cogvlm2": ("load_video_cogvlm2", {}),
    "minicpmv": ("load_video_minicpmv_mplug_owl3", {"max_num_frames": 4}),
    "valley": ("load_video_valley", {}),
    "llava": ("load_video_llava", {}),
    "hf": ("load_video_hf", {}),
    "vllm": ("load_vllm_video", {"num_frames": 6}),
    "ovis2": ("load_video_ovis2", {"num_frames": 6}),
    "ovis2_5": ("load_video_ovis2_5", {"num_frames": 6}),
    "qwen": ("fetch_video", {}),
}
AUDIO_CASES = ["librosa", "soundfile_pyav", "omni"]
AUDIO_RATE = 16000


def run_case(stock: bool, case: str, path: str):
    """(array, metadata) of one loader call, stock or twin."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import media_corpus

    if case in AUDIO_CASES:
        if case == "omni":
            conversation = [{"role": "user", "content": [{"type": "audio", "audio": path}]}]
            if stock:
                import qwen_omni_utils as module
            else:
                import swift_safe_media.decoders as module
            return np.asarray(module.process_audio_info(conversation, False)[0]), {}
        os.environ["SWIFT_AUDIO_LOAD_BACKEND"] = case
        if stock:
            import swift.template.vision_utils as module
        else:
            import swift_safe_media.decoders as module
        y, sr = module.load_audio(path, AUDIO_RATE, return_sr=True)
        return np.asarray(y), {"sr": int(sr)}
    function, kwargs = VIDEO_CASES[case]
    if function == "fetch_video":
        import qwen_vl_utils
        module = qwen_vl_utils if stock else __import__("swift_safe_media.decoders", fromlist=["x"])
    else:
        module = __import__("swift.template.vision_utils" if stock else "swift_safe_media.decoders", fromlist=["x"])
    frames, meta = media_corpus.run_video_case(module, function, kwargs, path)
    return frames, {k: v for k, v in meta.items() if k in ("total_num_frames", "frames_indices")}


def _stock_child(out_dir: str, jobs: list[list[str]]) -> None:
    """Run stock cases in order; a 'started' mark before each, its result after."""
    import traceback

    import numpy as np

    out = Path(out_dir)
    # The stock modules are imported before the first deadline starts: a deadline is for a
    # decode, and importing ms-swift takes seconds on a busy machine.
    for module in ("swift.template.vision_utils", "qwen_vl_utils", "qwen_omni_utils", "decord", "av", "cv2",
                   "moviepy.editor", "librosa", "transformers.video_utils"):
        try:
            __import__(module)
        except Exception:
            pass
    for key, case, path in jobs:
        (out / f"{key}.started").write_text(str(time.monotonic()))
        if "decord" in sys.modules:  # stock cogvlm2/valley switch decord's bridge to torch
            sys.modules["decord"].bridge.set_bridge("native")
        try:
            frames, meta = run_case(True, case, path)
            np.save(out / f"{key}.npy", frames)
            (out / f"{key}.json").write_text(json.dumps(meta))
        except BaseException:
            (out / f"{key}.err").write_text(traceback.format_exc()[-3000:])


def run_stock(jobs: list[tuple[str, str, str]], out_dir: str, case_timeout: float = 30.0,
              total_timeout: float = 400.0) -> None:
    """Results of stock loader calls (key, case, path) under `out_dir`: key.npy/.json,
    key.err when it raised, key.hang when it ran past `case_timeout` (killed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + total_timeout
    pending = [job for job in jobs if not _done(out, job[0])]
    while pending and time.monotonic() < deadline:
        code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import realworld; "
                "realworld._stock_child(sys.argv[2], json.loads(sys.argv[3]))")
        with open(out / "stderr.txt", "ab") as stderr:
            child = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).resolve().parent), str(out),
                                      json.dumps(pending)], cwd=str(out), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                                     env={**os.environ, "SWIFT_SAFE_MEDIA": "0"})
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            running = [job for job in pending if (out / f"{job[0]}.started").exists() and not _done(out, job[0])]
            if running and _age(out / f"{running[0][0]}.started") > case_timeout:
                os.killpg(child.pid, signal.SIGKILL)
                (out / f"{running[0][0]}.hang").write_text(f"no result within {case_timeout} s")
                break
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        left = [job for job in pending if not _done(out, job[0])]
        if left and len(left) == len(pending):  # the child died before finishing any: record it
            (out / f"{left[0][0]}.err").write_text("stock child died")
            left = left[1:]
        pending = left


def _age(path: Path) -> float:
    return time.time() - path.stat().st_mtime


def _done(out: Path, key: str) -> bool:
    return any((out / f"{key}{suffix}").exists() for suffix in (".npy", ".err", ".hang"))


def stock_result(out_dir: str, key: str):
    """("ok", array, meta) | ("error", text) | ("hang", text) | ("missing", "")."""
    import numpy as np

    out = Path(out_dir)
    if (out / f"{key}.npy").exists():
        return "ok", np.load(out / f"{key}.npy"), json.loads((out / f"{key}.json").read_text())
    for suffix, state in ((".err", "error"), (".hang", "hang")):
        if (out / f"{key}{suffix}").exists():
            return state, (out / f"{key}{suffix}").read_text()
    return "missing", ""
