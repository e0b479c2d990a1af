"""One import / enable / disable order for one adapter, in this fresh interpreter.

``python -m tests.programs.adapter_order HOST ORDER`` prints one JSON line: the state
of every target of the adapter's table after each step (True: ours, False: the host's).

- ``enable_first``: enable, import the host, enable again, disable, enable;
- ``import_first``: import the host, enable, enable again, disable, enable.
"""

from __future__ import annotations

import importlib
import json
import sys


def target_states(adapter) -> dict[str, bool]:
    from swift_safe_media.patching.targets import original_of

    states = {}
    for target in adapter.TARGETS:
        module = sys.modules[target.module]
        if target.is_method:
            class_name, method = target.name.split(".", 1)
            current = vars(getattr(module, class_name)).get(method)
            if target.only_if_missing:  # ours is the added method itself, or nothing
                ours = adapter.PATCHES.stand_in(target)
                if current is not None and current is not ours:
                    continue  # this host version has its own: nothing to add
                states[f"{target.module}.{target.name}"] = current is ours
                continue
        elif hasattr(module, target.name):
            current = getattr(module, target.name)
        else:
            continue  # not in this host version
        states[f"{target.module}.{target.name}"] = original_of(current) is not None
    return states


def main(host: str, order: str) -> None:
    import swift_safe_media
    from swift_safe_media.patching import host_adapters as integrations

    adapter = integrations.adapter_for(host)

    def import_host():
        for name in adapter.TRIGGER_MODULES:
            importlib.import_module(name)

    def snapshot(label):
        return {"step": label, "targets": target_states(adapter), "is_patched": adapter.is_patched(),
                "is_enabled": swift_safe_media.is_enabled(), "missing": adapter.PATCHES.missing()}

    steps = []
    if order == "enable_first":
        swift_safe_media.enable(hosts=[host])
        import_host()
    else:
        import_host()
        swift_safe_media.enable(hosts=[host])
    steps.append(snapshot("enabled"))
    swift_safe_media.enable(hosts=[host])
    steps.append(snapshot("enabled twice"))
    swift_safe_media.disable()
    steps.append(snapshot("disabled"))
    swift_safe_media.enable(hosts=[host])
    steps.append(snapshot("enabled again"))
    print(json.dumps(steps))


if __name__ == "__main__":
    main(*sys.argv[1:3])
