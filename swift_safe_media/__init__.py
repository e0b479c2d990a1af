"""swift-safe-media: bounded, isolated and recoverable media decoding for training pipelines."""

from .activation import disable, enable, is_enabled
from .engine import call, isolated, shutdown
from .errors import MediaDecodeCrash, MediaDecodeError, MediaDecodeTimeout, MediaQuarantined

__version__ = "0.1.0"

__all__ = ["call", "isolated", "shutdown", "enable", "disable", "is_enabled",
           "MediaDecodeError", "MediaDecodeTimeout", "MediaDecodeCrash", "MediaQuarantined",
           "__version__"]
