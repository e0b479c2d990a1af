"""The ``--safe_media*`` command-line flags, declared once for every host.

:data:`FLAGS` names each flag, the setting it writes (``config.write`` key) and its help;
types, choices and defaults come from the setting's entry in :mod:`..config`. Two
readers use it: :func:`add_arguments` builds the argparse group ms-swift's
``parse_args`` is taught, and :func:`take_flags` takes the flags out of a LeRobot
(draccus) command line, ``--name=value`` or ``--name value``. :func:`apply` then
writes them (flag > environment > default) and switches protection on or off.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from .. import config


@dataclass(frozen=True)
class Flag:
    option: str
    key: str  # "enabled" for --safe_media, else the config.write keyword
    metavar: str | None
    help: str


FLAGS = (
    Flag("--safe_media", "enabled", "{true,false}",
         "decode media in a sandbox with a hard timeout; skip and log bad samples (default: false, or SWIFT_SAFE_MEDIA)"),
    Flag("--safe_media_timeout", "timeout", "SECONDS", "seconds one decode may run"),
    Flag("--safe_media_mp_context", "mp_context", None,
         "start method of DataLoader workers; 'default' leaves the host's"),
    Flag("--safe_media_max_memory_mb", "max_memory_mb", "MB", "address space one decode may add; 0: no cap"),
    Flag("--safe_media_quarantine", "quarantine", "PATH",
         "JSON Lines registry of files that failed, refused at once afterwards; 'none': off"),
    Flag("--safe_media_stall_timeout", "stall_timeout", "SECONDS",
         "seconds without a batch before every process's stacks are logged; 0: off"),
    Flag("--safe_media_stall_action", "stall_action", None, "after the stacks, abort exits with code 75"),
)
BY_OPTION = {flag.option: flag for flag in FLAGS}
ENABLED = "enabled"

# Shown as the default where the setting's own default needs words.
_DEFAULT_WORDS = {"max_memory_mb": "RAM/4", "quarantine": "<output_dir>/safe_media/quarantine.jsonl"}


class FlagValueError(argparse.ArgumentTypeError, ValueError):
    """A malformed flag value: argparse shows its message; other callers catch ValueError."""


def parse_switch(text: str) -> bool:
    value = text.strip().lower()
    if value in config.TRUE_WORDS:
        return True
    if value in config.FALSE_WORDS:
        return False
    raise FlagValueError(f"expected true or false, got {text!r}")


def parse_registry(text: str) -> str:
    """A registry path; ``none`` / ``off`` / ``false`` / empty: quarantine off."""
    return "" if text.strip().lower() in ("", "none", "off", "false") else text


def _setting(flag: Flag) -> config.Setting:
    return config.SETTINGS[f"SWIFT_SAFE_MEDIA_{flag.key.upper()}"]


def add_arguments(group) -> None:
    """Add every flag to an argparse group (values default to None: not given)."""
    for flag in FLAGS:
        if flag.key == ENABLED:
            group.add_argument(flag.option, type=parse_switch, default=None, metavar=flag.metavar, help=flag.help)
            continue
        setting = _setting(flag)
        default = _DEFAULT_WORDS.get(flag.key)
        if default is None:
            value = setting.default_value()
            default = f"{value:g}" if isinstance(value, float) else value
        options = {"choices": setting.choices} if setting.kind == config.CHOICE else {
            "type": {config.FLOAT: float, config.INT: int, config.PATH: parse_registry}[setting.kind],
            "metavar": flag.metavar}
        group.add_argument(flag.option, default=None, help=f"{flag.help} (default: {default}, or {setting.name})",
                           **options)


def take_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """Split ``--safe_media=true`` / ``--safe_media true`` style flags from the rest.

    Returns ``({key: value}, the rest)``: ``enabled`` as a bool (a bare ``--safe_media``
    means true), the quarantine path with ``none`` as empty, other values as given
    (``config.write`` checks them)."""
    values, remaining = {}, []
    position = 0
    while position < len(argv):
        arg = argv[position]
        position += 1
        name, has_value, value = arg.partition("=")
        flag = BY_OPTION.get(name)
        if flag is None:
            remaining.append(arg)
            continue
        if not has_value:
            if position < len(argv) and not argv[position].startswith("--"):
                value = argv[position]
                position += 1
            elif flag.key == ENABLED:
                value = "true"  # a bare --safe_media
            else:
                raise ValueError(f"{name} needs a value")
        if flag.key == ENABLED:
            try:
                values[ENABLED] = parse_switch(value)
            except FlagValueError:
                raise ValueError(f"{name}={value!r}: expected true or false") from None
        else:
            values[flag.key] = parse_registry(value) if flag.key == "quarantine" else value
    return values, remaining


def argument(argv: list[str], option: str) -> str | None:
    """The value of ``option`` (``--name``) on a host's command line, ``--name=value`` or
    ``--name value``: ``""`` when it is there without a value, None when it is not there.
    The one reader of the hosts' command lines (ms-swift's, LeRobot's, LLaMA-Factory's)."""
    for position, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option:
            following = argv[position + 1] if position + 1 < len(argv) else ""
            return "" if following.startswith("--") else following
    return None


def apply(values: dict, host: str) -> None:
    """Write the settings given, then turn protection on (``enabled`` true) or off (false)
    for ``host``; with ``enabled`` None the environment decides elsewhere."""
    from .. import activation

    values = dict(values)
    enabled = values.pop(ENABLED, None)
    config.write(source="flag", **values)
    if enabled is True:
        activation.enable(hosts=[host])
    elif enabled is False:
        activation.disable()


def asks_for_protection(argv: list[str]) -> bool:
    """Whether a command line says ``--safe_media`` (true), as the hosts' start-up hook
    reads it before the host parses anything. A malformed flag: False (the host's parser
    reports it)."""
    try:
        values, _ = take_flags(argv)
    except ValueError:
        return False
    return values.get(ENABLED) is True


_CONFIG_SUFFIXES = (".yaml", ".yml")


def config_file_asks_for_protection(argv: list[str]) -> bool:
    """Whether a LLaMA-Factory-style command line (``train run.yaml [key=value ...]``)
    turns protection on: a ``safe_media=true`` override, or a top-level ``safe_media:
    true`` line in the YAML file it names (read as text: no YAML parser at this point)."""
    overrides = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))
    if "safe_media" in overrides:
        return overrides["safe_media"].strip().lower() in config.TRUE_WORDS
    for arg in argv:
        if arg.endswith(_CONFIG_SUFFIXES) and os.path.isfile(arg):
            try:
                with open(arg, encoding="utf-8") as text:
                    for line in text:
                        key, colon, value = line.partition(":")
                        if colon and key == "safe_media":
                            return value.split("#", 1)[0].strip().strip("'\"").lower() in config.TRUE_WORDS
            except (OSError, UnicodeDecodeError):
                return False
    return asks_for_protection(argv)
