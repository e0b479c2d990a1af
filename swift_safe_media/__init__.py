"""swift-safe-media: bounded, isolated and recoverable media decoding for training pipelines."""

from . import _moved
from .logs import package_logger

_moved.install()  # old module paths (swift_safe_media.pool, ...) keep working
package_logger()

from .activation import disable, enable, is_enabled  # noqa: E402
from .engine.calls import BY_NAME, call, isolated, shutdown  # noqa: E402
from .workers.skipping import skip_bad_samples  # noqa: E402
from .errors import (MediaDecodeCrash, MediaDecodeError, MediaDecodeTimeout, MediaMachineFault,  # noqa: E402
                     MediaQuarantined, ProtectionUnavailable)

__version__ = "0.1.0"

__all__ = ["call", "isolated", "shutdown", "BY_NAME", "enable", "disable", "is_enabled", "skip_bad_samples",
           "MediaDecodeError", "MediaDecodeTimeout", "MediaDecodeCrash", "MediaQuarantined", "MediaMachineFault",
           "ProtectionUnavailable",
           "__version__"]
