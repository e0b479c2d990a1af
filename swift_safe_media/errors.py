"""Errors raised by swift_safe_media. Each names the media file and the reason."""

from __future__ import annotations


FILE, MACHINE = "file", "machine"  # whose fault a failure is (see swift_safe_media.engine.faults)


class MediaDecodeError(RuntimeError):
    """A media item could not be decoded; ``.path`` names it and ``.reason`` says why.

    ``.fault`` says whose fault it was: ``"file"`` (the default: the decode itself
    failed, hung or crashed) or ``"machine"`` (see :class:`MediaMachineFault`).
    ``.ambiguous`` marks a file's failure that is not proof on its own (a timeout cut
    short by the ceiling while the CPU was starved): the file is quarantined only if it
    fails again."""

    fault = FILE
    ambiguous = False

    def __init__(self, path, reason: str, elapsed: float | None = None):
        self.path = None if path is None else str(path)
        self.reason = reason
        self.elapsed = elapsed
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"{self.path if self.path is not None else '<unnamed media>'}: {self.reason}"
        if self.elapsed is not None:
            text += f" (after {self.elapsed:.2f} s)"
        return text

    def with_context(self, path, elapsed):
        """A copy that fills in what the raiser did not know (the caller knows the path)."""
        copy = type(self)(self.path if self.path is not None else path, self.reason,
                          self.elapsed if self.elapsed is not None else elapsed)
        copy.__dict__.update(self._verdict())
        return copy

    def _verdict(self) -> dict:
        """What was decided about whose fault this is, where it differs from the class's."""
        return {name: self.__dict__[name] for name in ("fault", "ambiguous") if name in self.__dict__}

    def __reduce__(self):
        verdict = self._verdict()
        return (type(self), (self.path, self.reason, self.elapsed)) + ((verdict,) if verdict else ())


class MediaDecodeTimeout(MediaDecodeError):
    """The decode overran its timeout; the sandbox running it was killed."""


class MediaDecodeCrash(MediaDecodeError):
    """The sandbox died during the decode (a signal or an exit code is in the reason)."""


class MediaQuarantined(MediaDecodeError):
    """The file failed before and has not changed since, so it is refused at once."""


class MediaMachineFault(MediaDecodeError):
    """The decode failed because of the machine, not the file: its sandbox was killed
    from outside (the OOM killer, an operator's ``kill``), could not start, lost its
    zygote or its transport, or ran out of a machine resource. It was retried in a fresh
    sandbox and failed again; the file is never quarantined for it."""

    fault = MACHINE


def short_reason(exc: BaseException) -> str:
    """One line naming what a decoder or library raised: its type and the last line of its
    message (where native code puts the cause), at most 300 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def decode_failure(label, exc: BaseException, what: str, by: str) -> BaseException:
    """The error for a decoder (`by`) that raised `exc` while `what`: a MemoryError when
    it was an allocation failure (so the caller reports the memory cap and replaces the
    sandbox), else MediaDecodeError("decode failed (by): ...")."""
    if is_out_of_memory(exc):
        return MemoryError(f"{what}: {short_reason(exc)}")
    return MediaDecodeError(label, f"decode failed ({by}): {short_reason(exc)}")


def typed_entry(entry):
    """A decoder's sandbox entry (its first argument: the input, or a list of inputs, each
    with a ``.label``) whose every failure is a MediaDecodeError naming the input: what
    soundfile, PyAV, torchcodec, soxr or PIL raise of their own types comes back as
    ``decode failed: Type: message``. Allocation failures stay MemoryError (the caller
    reports the memory cap and replaces the sandbox)."""
    import functools

    @functools.wraps(entry)
    def run(source, *args, **kwargs):
        try:
            return entry(source, *args, **kwargs)
        except (MediaDecodeError, MemoryError):
            raise
        except Exception as exc:
            if is_out_of_memory(exc):
                raise MemoryError(short_reason(exc)) from None
            first = source[0] if isinstance(source, (list, tuple)) and source else source
            raise MediaDecodeError(getattr(first, "label", None), f"decode failed: {short_reason(exc)}") from None
    return run


# How allocation failures read when they do not arrive as MemoryError: C++ allocators
# under RLIMIT_AS ("can't allocate memory", bad_alloc), OSError errno 12, and torch's
# stable ABI, which torchcodec calls through and which hides the reason of a failed
# aten::empty (its only way to fail on valid sizes is an allocation).
_OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "cannot allocate memory", "std::bad_alloc", "out of memory",
                        'torch_call_dispatcher( "aten::empty"', 'torch_call_dispatcher("aten::empty"')


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is an allocation failure."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == 12):
            return True
        # A MediaDecodeError's message names the file, whose name proves nothing.
        text = (exc.reason if isinstance(exc, MediaDecodeError) else str(exc)).lower()
        if any(marker.lower() in text for marker in _OUT_OF_MEMORY_TEXTS):
            return True
        if ((isinstance(exc, OSError) and exc.errno == 11) or "resource temporarily unavailable" in text) \
                and _at_address_space_cap():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _at_address_space_cap() -> bool:
    """Whether this process came within one thread stack of its RLIMIT_AS (a sandbox's
    memory cap). There a decoder's new thread fails with EAGAIN, not ENOMEM, because its
    stack cannot be mapped. Without a cap (the caller) this is always False."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return False
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    if stack == resource.RLIM_INFINITY or stack <= 0:
        stack = 8 << 20  # glibc's default thread stack on 64-bit Linux
    try:
        with open("/proc/self/status") as status:
            peak = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmPeak:"))
    except (OSError, StopIteration, ValueError):
        return False
    return peak + stack >= limit


class ProtectionUnavailable(RuntimeError):
    """Protection was asked for but the decoders cannot load here (``enable()`` checks once,
    before any worker starts). ``.missing`` names the piece, ``.fix`` the command that
    installs it; the message carries both."""

    def __init__(self, missing: str, fix: str):
        self.missing = missing
        self.fix = fix
        super().__init__(f"swift-safe-media cannot protect this run: {missing}.\n  Fix: {fix}\n"
                         "  (or run without protection: --safe_media false, SWIFT_SAFE_MEDIA=0)")

    def __reduce__(self):
        return type(self), (self.missing, self.fix)
