"""A child process calling ``enable()``: does it inspect the decoders again?

``python -m tests.programs.preflight_child`` enables protection and prints
``inspected: N``, N the number of pre-flight verdicts this process worked out itself (0
when it took its parent's from the environment).
"""

from __future__ import annotations


def main() -> None:
    import swift_safe_media
    from swift_safe_media.checks import preflight

    swift_safe_media.enable()
    print("inspected:", len(preflight._verdicts))


if __name__ == "__main__":
    main()
