"""Errors raised by swift_safe_media. Each names the media file and the reason."""

from __future__ import annotations


class MediaDecodeError(RuntimeError):
    """A media item could not be decoded; ``.path`` names it and ``.reason`` says why."""

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
        return type(self)(self.path if self.path is not None else path, self.reason,
                          self.elapsed if self.elapsed is not None else elapsed)

    def __reduce__(self):
        return type(self), (self.path, self.reason, self.elapsed)


class MediaDecodeTimeout(MediaDecodeError):
    """The decode overran its timeout; the sandbox running it was killed."""


class MediaDecodeCrash(MediaDecodeError):
    """The sandbox died during the decode (a signal or an exit code is in the reason)."""


class MediaQuarantined(MediaDecodeError):
    """The file failed before and has not changed since, so it is refused at once."""
