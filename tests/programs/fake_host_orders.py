"""The adapter machinery on the small host package ``fakehost`` (written at test time by
tests/test_integration_framework.py, with its adapter ``fake_adapter``, both found on
``PYTHONPATH``): one import / enable / disable order per case, in this fresh interpreter.

``python -m tests.programs.fake_host_orders CASE [VALUE]`` prints what the case shows,
``state()`` being the three results of ``load("a")`` through the host's module and its
two alias sites. Logs go to stderr as ``LOG ...``. CASE is one of:

- ``enable_first``: enable, then the state, ``is_enabled()`` and ``SWIFT_SAFE_MEDIA``;
- ``enable_after``: the state before and after enable;
- ``enable_disable_enable``: enable twice, disable, enable (with identity checks), then
  the patcher's sites;
- ``settings``: enable with settings, print them from the environment, then a refused value;
- ``enable``: enable, then the state;
- ``reload``: import the host, enable, the state, then reload the host module;
- ``startup_hook [VALUE]``: set ``SWIFT_SAFE_MEDIA`` to VALUE (if given), install the
  start-up watcher for ``fakehost``, then the state.
"""

from __future__ import annotations

import logging
import os
import sys

logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")

import swift_safe_media  # noqa: E402  (after the logging set-up, as the host's program would)
from swift_safe_media.patching import host_adapters as integrations  # noqa: E402

integrations.known_hosts = lambda: ["fakehost"]  # the only host of this program
import fake_adapter  # noqa: E402,F401  (an adapter outside hosts/: it registers itself)


def state():
    import fakehost.media, fakehost.user  # noqa: E401
    return (fakehost.media.load("a"), fakehost.user.load("a"), fakehost.user.renamed_load("a"))


def enable_first():
    swift_safe_media.enable()
    print(state(), swift_safe_media.is_enabled(), os.environ["SWIFT_SAFE_MEDIA"])


def enable_after():
    print(state())
    swift_safe_media.enable()
    print(state())


def enable_disable_enable():
    import fakehost.media
    stock = fakehost.media.load
    swift_safe_media.enable()
    swift_safe_media.enable()
    print(state(), fakehost.media.load.__wrapped__ is stock)
    swift_safe_media.disable()
    print(state(), fakehost.media.load is stock, os.environ["SWIFT_SAFE_MEDIA"], swift_safe_media.is_enabled())
    swift_safe_media.enable()
    print(state())
    import fake_adapter
    print(sorted(fake_adapter._patcher.sites()))


def settings():
    swift_safe_media.enable(timeout=7.5, mp_context="forkserver", max_memory_mb=1024)
    print(os.environ["SWIFT_SAFE_MEDIA_TIMEOUT"], os.environ["SWIFT_SAFE_MEDIA_MP_CONTEXT"],
          os.environ["SWIFT_SAFE_MEDIA_MAX_MEMORY_MB"])
    try:
        swift_safe_media.enable(mp_context="threads")
    except ValueError as exc:
        print("refused:", exc)


def enable():
    swift_safe_media.enable()
    print(state())


def reload():
    import importlib
    import fakehost.media
    swift_safe_media.enable()
    print(state())
    importlib.reload(fakehost.media)


def startup_hook(value=None):
    if value is not None:
        os.environ["SWIFT_SAFE_MEDIA"] = value
    sys.modules.pop("fakehost", None)
    import _swift_safe_media_startup as startup
    startup._HOSTS = ("fakehost",)
    del sys._swift_safe_media_watcher
    startup.install()
    print(state())


CASES = {case.__name__: case for case in (enable_first, enable_after, enable_disable_enable, settings, enable,
                                           reload, startup_hook)}


if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
