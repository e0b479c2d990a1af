"""The package's log lines must reach the user: they are how a skipped or stuck file
gets named. Hosts often mute the root logger (ms-swift sets its stream handler to
ERROR on every rank), so, like transformers, the package logger has its own stderr
handler and does not propagate. ``SWIFT_SAFE_MEDIA_LOG_LEVEL`` sets its level."""

import logging
import sys

from . import config


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (hosts and test runners swap it)."""

    def __init__(self):
        logging.Handler.__init__(self)

    @property
    def stream(self):
        return sys.stderr


def package_logger() -> logging.Logger:
    logger = logging.getLogger("swift_safe_media")
    if not logger.handlers:
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        try:
            level = config.get(config.LOG_LEVEL)
        except ValueError:  # importing the package never fails; enable() names the bad value
            level = "WARNING"
        logger.setLevel(level)
    return logger
