"""How ``llamafactory-cli train``'s arguments turn protection on, in this fresh interpreter
(LLaMA-Factory's own environment).

``python -m tests.programs.llamafactory_flags ARG...`` sets ``sys.argv`` to
``llamafactory-cli train ARG...``, parses it as the CLI does (``get_train_args``: the YAML
through OmegaConf, ``HfArgumentParser``), and prints one JSON line: whether it parsed (or
the error), whether protection is on, the settings written, whether ``mm_plugin`` is patched.
"""

from __future__ import annotations

import json
import os
import sys


def main(args: list[str]) -> None:
    sys.argv = ["llamafactory-cli", *args]  # launcher.launch() pops the command ("train")
    from llamafactory.data import mm_plugin
    from llamafactory.hparams import get_train_args

    import swift_safe_media
    from swift_safe_media.patching.targets import original_of

    try:
        parsed = get_train_args()
        error = None
    except (ValueError, SystemExit) as exc:
        parsed, error = None, f"{type(exc).__name__}: {exc}"
    print(json.dumps({
        "error": error, "output_dir": parsed[2].output_dir if parsed else None,
        "enabled": swift_safe_media.is_enabled(),
        "settings": {name: value for name, value in os.environ.items() if name.startswith("SWIFT_SAFE_MEDIA")},
        "patched": original_of(vars(mm_plugin.MMPluginMixin)["_regularize_videos"]) is not None,
    }))


if __name__ == "__main__":
    main(sys.argv[1:])
