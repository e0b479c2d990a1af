"""``swift-safe-media doctor``: one screen that says what is installed and in force here.

Decoders (torch, torchcodec, FFmpeg, soundfile, soxr: versions, and whether they load
together, from the same check ``enable()`` makes), the host frameworks and whether
their versions are supported, every setting in effect and where it came from, the
DataLoader workers' start method, the sandbox's confinement, and one sample decode
through a sandbox with its time. Exits 1 when protection cannot work here.

``doctor --script train.py`` shows instead the media openers that script's DataLoader
reaches and ``enable()`` does not bound (:mod:`.user_code`), as ``enable()`` logs them.
"""

from __future__ import annotations

import io
import math
import platform
import struct
import sys
import time
import wave

from .. import config
from . import preflight

# How a value reads where "unset" alone would not say what happens.
_UNSET_MEANS = {config.ENABLED: "unset (off unless a flag turns it on)",
                config.QUARANTINE: "unset (ms-swift, LeRobot: <output_dir>/safe_media/quarantine.jsonl)"}


def _shown(name: str, value) -> str:
    if value is None:
        return _UNSET_MEANS.get(name, "unset")
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(value)
    if isinstance(value, float):
        return f"{value:g}"
    if value == "" and name == config.QUARANTINE:
        return "off"
    return str(value)


def settings_in_effect() -> list[tuple[str, str, str]]:
    """(variable, value in effect, where it came from: flag, environment or default), for
    every setting of the registry a user sets."""
    rows = []
    for name, setting in config.SETTINGS.items():
        if setting.internal:
            continue
        try:
            value = _shown(name, config.get(name))
        except ValueError as exc:  # malformed: enable() would refuse it; say so here too
            value = f"INVALID: {exc}"
        rows.append((name, value, config.origin(name)))
    return rows


def hosts_found() -> list[tuple[str, str | None, str, bool]]:
    """(distribution, installed version or None, supported range, supported?) per adapter."""
    from ..patching import host_adapters as integrations

    rows = []
    import _swift_safe_media_startup as hook  # the hosts in the order it watches them (ms-swift first)

    known = integrations.known_hosts()
    for host in [host for host in hook._HOSTS if host in known] + [host for host in known if host not in hook._HOSTS]:
        adapter = integrations.adapter_for(host)
        version = adapter.get_version()
        rows.append((adapter.DISTRIBUTION, version, integrations.supported_range(adapter.SUPPORTED),
                     integrations.in_supported_range(adapter, version)))
    return rows


# --- the sample decode, in a sandbox ------------------------------------------------

def sample_clip(width: int = 32, height: int = 32, frames: int = 8) -> bytes:
    """A YUV4MPEG2 clip built in memory (no encoder needed): frame i has luma 16 + 16 i."""
    header = f"YUV4MPEG2 W{width} H{height} F10:1 Ip A1:1 C420jpeg\n".encode()
    chroma = bytes([128]) * (2 * ((width + 1) // 2) * ((height + 1) // 2))
    return header + b"".join(b"FRAME\n" + bytes([16 + 16 * i]) * (width * height) + chroma for i in range(frames))


def sample_wav(seconds: float = 0.25, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * n / rate)))
                                 for n in range(int(seconds * rate))))
    return out.getvalue()


def decode_samples(clip: bytes | None, wav: bytes | None) -> str:
    """Runs in a sandbox: decode the sample clip (torchcodec) and sound (soundfile, soxr)."""
    done = []
    if clip is not None:
        from torchcodec.decoders import VideoDecoder

        decoder = VideoDecoder(clip)
        batch = decoder.get_frames_at(indices=list(range(decoder.metadata.num_frames)))
        lumas = [int(frame[0].float().mean().round()) for frame in batch.data]
        # FFmpeg's RGB conversion maps luma 16 + 16 i (limited range) onto about 18.6 i.
        if len(lumas) < 2 or lumas != sorted(lumas) or lumas[0] > 8:
            raise ValueError(f"sample clip decoded wrong: mean red per frame {lumas}")
        done.append(f"{len(lumas)} frames of {batch.data.shape[-1]}x{batch.data.shape[-2]} by torchcodec")
    if wav is not None:
        import soundfile
        import soxr

        samples, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
        resampled = soxr.resample(samples, rate, 8000, quality="soxr_hq")
        if abs(len(resampled) - len(samples) * 8000 / rate) > 2 or not 0.1 < float(abs(samples).max()) < 0.5:
            raise ValueError("sample sound decoded wrong")
        done.append(f"{len(samples) / rate:g} s of sound by soundfile, resampled by soxr")
    return ", ".join(done)


def sample_decode(findings) -> tuple[bool, str]:
    """(worked?, what happened): the sample decoded through a sandbox, first and warm call."""
    from ..engine import calls as engine

    usable = {finding.name for finding in findings if finding.ok and finding.version}
    clip = sample_clip() if "torchcodec" in usable else None
    wav = sample_wav() if {"soundfile", "soxr"} <= usable else None
    if clip is None and wav is None:
        return False, "skipped: no decoder can load"
    times = []
    try:
        for _ in range(2):
            start = time.perf_counter()
            described = engine.call(decode_samples, clip, wav, path="<doctor sample>")
            times.append(time.perf_counter() - start)
    except Exception as exc:  # MediaDecodeError, or the decoder's own error from the sandbox
        return False, f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        engine.shutdown()
    return True, (f"ok: {described}; first call {times[0]:.2f} s (sandbox start-up), "
                  f"then {times[1] * 1e3:.0f} ms")


def confinement() -> str:
    try:
        from ..confinement import policy as confine
    except ImportError:
        return "not available in this version"
    try:
        status = confine.status()
    except Exception as exc:  # the report must go on
        return f"unknown ({type(exc).__name__}: {exc})"
    if isinstance(status, dict):
        return ", ".join(_confinement_item(key, value) for key, value in status.items())
    return str(status)


def decode_paths() -> str:
    """How many decode paths run confined here, and each that does not, with why."""
    try:
        from ..confinement import policy as confine
        from ..decoders import stock

        status = confine.status()
        paths = stock.decode_paths(status["enabled"], bool((status.get("reads") or {}).get("limited")))
    except Exception as exc:  # the report must go on
        return f"unknown ({type(exc).__name__}: {exc})"
    loose = {name: how for name, how in paths.items() if how.startswith("not confined")}
    listed = "; ".join(f"{name} ({how.removeprefix('not confined: ')})" for name, how in loose.items())
    return (f"{len(paths) - len(loose)} confined; not confined: {listed or 'none'} "
            f"(`swift-safe-media confinement` lists each)")


def _confinement_item(key, value) -> str:
    """One setting of ``confine.status()``, short: the read and environment policies in words."""
    if key == "reads" and isinstance(value, dict):
        if not value.get("limited"):
            return f"reads anywhere ({value.get('why')})"
        return (f"reads only the media handed to each decode, its own /proc/<pid> and {len(value.get('roots') or ())} "
                f"roots (Python, shared libraries, system files; `swift-safe-media confinement` lists them)")
    if key == "environment" and isinstance(value, dict):
        withheld = value.get("withheld_here") or []
        shown = ", ".join(withheld[:10]) + (f" and {len(withheld) - 10} more" if len(withheld) > 10 else "")
        return (f"environment allow-listed ({len(value.get('kept_here') or ())} variables kept; "
                f"withheld here: {shown or 'none'})")
    if isinstance(value, dict):
        return f"{key} {sum(len(item) if isinstance(item, (list, tuple)) else 1 for item in value.values())}"
    return f"{key} {len(value) if isinstance(value, (list, tuple)) else value}"


# --- the screen ---------------------------------------------------------------------

def _line(label: str, text: str, mark: str = "") -> str:
    return f"  {label:<15} {text}" + (f"  [{mark}]" if mark else "")


def _say_decoders(say, findings) -> None:
    say("\ndecoders")
    for finding in findings:
        text = " ".join(part for part in (finding.version or ("not installed" if not finding.ok else ""),
                                          f"({finding.detail})" if finding.detail else "") if part)
        say(_line(finding.name, text, "ok" if finding.ok else "MISSING" if not finding.version else "BROKEN"))
    torch_version = next((f.version for f in findings if f.name == "torch"), None)
    torchcodec = next((f for f in findings if f.name == "torchcodec"), None)
    if torch_version and torchcodec is not None:
        wanted = preflight.torchcodec_requirement(torch_version)
        verdict = ("they load together" if torchcodec.ok and torchcodec.version
                   else "they do not load together" if torchcodec.version else "install it")
        say(_line("pairing", f"torch {torch_version} goes with {wanted} (torchcodec's table); {verdict}"))


def _say_targets(say) -> None:
    """The patch targets the installed releases lack or changed (swift-safe-media targets)."""
    from . import targets

    try:
        found, not_imported = targets.problems()
    except Exception as exc:  # never stop the doctor: say it could not look
        say(_line("patch targets", f"could not be checked ({type(exc).__name__}: {exc})", "UNKNOWN"))
        return
    if not found:
        unchecked = (f"; unchecked in {', '.join(not_imported)}, which do not import here, so no run here can "
                     f"use them either (swift-safe-media targets says why)" if not_imported else "")
        say(_line("patch targets", f"every target that should exist here does, as recorded{unchecked}", "ok"))
    for finding in found:
        say(_line("patch target", finding.message(), finding.problem.upper()))


def report(out=sys.stdout) -> int:
    from .. import __version__

    def say(text=""):
        print(text, file=out, flush=True)

    say(f"swift-safe-media {__version__}: doctor (Python {platform.python_version()}, {sys.executable})")
    hosts = hosts_found()
    installed_hosts = [name for name, version, _, _ in hosts if version]
    needs = preflight.needs_of([{"ms-swift": "swift", "lerobot": "lerobot", "llamafactory": "llamafactory"}[name] for name in installed_hosts]
                               or None)
    findings = preflight.inspect(needs)
    problems = [finding for finding in findings if not finding.ok and finding.required]
    warnings = [finding for finding in findings if not finding.ok and not finding.required]

    _say_decoders(say, findings)

    say("\nhosts")
    for name, version, span, supported in hosts:
        state = "not installed" if version is None else f"{version}, {'supported' if supported else 'NOT supported'}"
        say(_line(name, f"{state} ({span})", "" if version is None else "ok" if supported else "untouched"))

    _say_targets(say)

    say("\nsettings (flag > environment > default)")
    rows = settings_in_effect()
    width = max(len(variable) for variable, _, _ in rows)
    for variable, value, source in rows:
        say(f"  {variable:<{width}}  {value}  ({source})")
    invalid = [variable for variable, value, _ in rows if value.startswith("INVALID")]

    say("\nworkers and sandboxes")
    try:
        method = config.mp_context()
        say(_line("start method", "the host's own (fork on Linux)" if method == "default"
                  else f"{method} (DataLoader workers of a protected run)"))
    except ValueError as exc:
        say(_line("start method", f"INVALID: {exc}"))
    say(_line("confinement", confinement()))
    say(_line("decode paths", decode_paths()))
    worked, text = sample_decode(findings)
    say(_line("sample decode", text, "ok" if worked else "FAILED"))

    say("")
    for finding in warnings:  # not needed by every run: ms-swift needs qwen_omni_utils for Omni models only
        say(f"warning: {finding.problem}.\n  Fix: {finding.fix}")
    if problems or invalid or not worked:
        for finding in problems:
            say(str(preflight.ProtectionUnavailable(finding.problem, finding.fix)))
        for variable in invalid:
            say(f"swift-safe-media cannot protect this run: {variable} is malformed (see above).")
        if not problems and not invalid:
            say("swift-safe-media cannot protect this run: the sample decode failed in the sandbox (see above).")
        return 1
    say("protection can work here: enable it with --safe_media true (ms-swift, LeRobot) or SWIFT_SAFE_MEDIA=1")
    return 0


def report_script(path: str, out=None) -> int:
    """``doctor --script train.py``: the media openers the script's DataLoader reaches that
    ``enable()`` does not bound, read from its source (never run), as ``enable()`` logs
    them. Exits 0 with or without findings; 2 when the script cannot be read or parsed."""
    from . import user_code

    out = out or sys.stdout  # the one in force now (a test's capture, say)
    try:
        findings = user_code.scan_script(path)
    except (OSError, SyntaxError, ValueError) as exc:
        print(f"swift-safe-media doctor: cannot read {path}: {exc}", file=out)
        return 2
    for finding in findings:
        print(finding.message(), file=out)
    if findings:
        print(f"{len(findings)} unbounded media opener(s) found in {path} and the modules of its own it imports: "
              "a hang there stalls the run with no error (bound each as its line says)", file=out)
    else:
        print(f"no unbounded media openers found in {path} and the modules of its own it imports", file=out)
    return 0
