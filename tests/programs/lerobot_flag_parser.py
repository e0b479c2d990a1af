"""LeRobot's flag parser with this program's command line (``--safe_media=true`` ...).

``python -m tests.programs.lerobot_flag_parser FLAGS...`` imports
``lerobot.configs.parser`` (where the start-up hook reads the flags), then prints
``protected: BOOL``.
"""

from __future__ import annotations


def main() -> None:
    import lerobot.configs.parser  # noqa: F401  (the import applies the flags)
    import swift_safe_media

    print("protected:", swift_safe_media.is_enabled())


if __name__ == "__main__":
    main()
