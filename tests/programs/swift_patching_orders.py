"""The ms-swift adapter against the real ms-swift, one import / enable / disable order per
case, in this fresh interpreter.

``python -m tests.programs.swift_patching_orders CASE [ARG]`` prints ``LABEL SITES ENABLED``
lines: SITES is a JSON object giving, for every module of the adapter's scope that holds a
copy of a patched host loader, ``"stock"`` or ``"safe"``; ENABLED is ``is_enabled()``.
CASE is one of:

- ``enable_first FIFO``: enable, then import a template and load FIFO through it (prints
  ``raised {} True`` when the error names FIFO);
- ``enable_after``: import ms-swift, enable twice, disable (asserting every loader is the
  stock object again), enable, import a template late;
- ``startup_hook``: only import the Qwen utils (protection comes from the start-up hook);
- ``unsupported``: enable with ms-swift's version reported as 3.9.0;
- ``older SWIFT_DIR``: the ms-swift found first is under SWIFT_DIR; also prints
  ``flag PATCHED VERSION`` for ``parse_args``.
"""

from __future__ import annotations

import json
import sys

import swift_safe_media
from swift_safe_media.hosts.swift import adapter
from swift_safe_media.patching.targets import original_of


def state():
    import qwen_omni_utils, qwen_vl_utils, swift.template.templates.qwen, swift.template.base  # noqa: E401,F401
    sites = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(adapter.SCOPE) or module is None:
            continue
        for host_module, name in [(target.module, target.name) for target in adapter.TARGETS
                                  if not target.is_method]:
            value = getattr(module, name, None)
            stock = getattr(sys.modules[host_module], name, None)
            if stock is None:
                continue  # not in this ms-swift version
            stock = original_of(stock) or stock
            if value is stock:
                sites[f"{module_name}.{name}"] = "stock"
            elif original_of(value) is stock:
                sites[f"{module_name}.{name}"] = "safe"
    return sites


def report(label):
    print(label, json.dumps(state(), sort_keys=True, separators=(",", ":")), swift_safe_media.is_enabled(), flush=True)


def enable_first(fifo):
    swift_safe_media.enable(timeout=5, hosts=["swift"])
    report("enabled")
    from swift.template.templates import qwen
    try:
        qwen.load_audio(fifo, 16000)
    except swift_safe_media.MediaDecodeError as exc:
        print("raised", "{}", exc.path == fifo)


def enable_after():
    report("stock")
    import swift.template.vision_utils as vision_utils, qwen_vl_utils.vision_process as vision_process  # noqa: E401
    before = {name: id(getattr(vision_utils, name)) for name in dir(vision_utils) if name.startswith("load_")}
    before_fetch = id(vision_process.fetch_video)
    swift_safe_media.enable(hosts=["swift"])
    swift_safe_media.enable(hosts=["swift"])
    report("enabled_twice")
    swift_safe_media.disable()
    after = {name: id(getattr(vision_utils, name)) for name in dir(vision_utils) if name.startswith("load_")}
    assert before == after and before_fetch == id(vision_process.fetch_video)
    report("disabled")
    swift_safe_media.enable(hosts=["swift"])
    report("enabled_again")
    import swift.template.templates.valley  # noqa: F401  (imported after the patch: copies the safe one)
    report("late_import")


def startup_hook():
    import qwen_omni_utils, qwen_vl_utils  # noqa: E401,F401
    report("plain")


def unsupported():
    adapter.get_version = lambda: "3.9.0"
    swift_safe_media.enable(hosts=["swift"])
    import importlib, swift.template.vision_utils  # noqa: E401
    importlib.reload(swift.template.vision_utils)
    report("unsupported")


def older(swift_dir):
    import swift
    assert swift.__file__.startswith(swift_dir), swift.__file__
    report("older")
    from swift.utils import parse_args
    print("flag", original_of(parse_args) is not None, adapter.get_version())


CASES = {case.__name__: case for case in (enable_first, enable_after, startup_hook, unsupported, older)}


if __name__ == "__main__":
    CASES[sys.argv[1]](*sys.argv[2:])
