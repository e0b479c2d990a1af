"""What a setting is and how it lives in the environment: its kinds, how its text
parses, and reading and writing it (:func:`get`, :func:`put`). The settings themselves
are declared in :mod:`swift_safe_media.config`, once each; every other module reaches
this one through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FLOAT, INT, CHOICE, SWITCH, TEXT, PATH, LIST = "float", "int", "choice", "switch", "text", "path", "list"

# The true/false words of every switch and flag (``--safe_media true``, ``SWIFT_SAFE_MEDIA=1``).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    name: str  # the environment variable
    kind: str
    default: object  # a value, or a function that returns it
    doc: str  # one line, as in docs/settings.md
    minimum: float | None = None
    above: float | None = None  # an exclusive lower bound
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    internal: bool = False  # set by the package for its children; users leave it alone

    def default_value(self):
        return self.default() if callable(self.default) else self.default


SETTINGS: dict[str, Setting] = {}


def declare(name: str, kind: str, default, doc: str, **bounds) -> str:
    if name in SETTINGS:
        raise ValueError(f"setting {name} declared twice")
    SETTINGS[name] = Setting(name, kind, default, doc, **bounds)
    return name


# -- reading --------------------------------------------------------------------------
def parse(setting: Setting, raw: str | None):
    """The value of ``setting`` given the variable's text (None: unset)."""
    if setting.kind in (TEXT, PATH, LIST):
        if raw is None:
            raw = setting.default_value()
            if raw is None:
                return None
        if setting.kind == LIST:
            return [part.strip() for part in raw.split(",") if part.strip()]
        return raw.strip() if setting.kind == PATH else raw
    text = (raw or "").strip()
    if not text:
        return setting.default_value()
    if setting.kind == SWITCH:
        word = text.lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise ValueError(f"{setting.name}={raw!r}: expected true or false ({', '.join(TRUE_WORDS + FALSE_WORDS)})")
    if setting.kind == CHOICE:
        for choice in setting.choices:
            if choice.lower() == text.lower():
                return choice
        raise ValueError(f"{setting.name}={text!r} must be one of {', '.join(setting.choices)}")
    return _number(setting, text)


def _number(setting: Setting, text: str):
    kind = int if setting.kind == INT else float
    try:
        value = kind(text)
    except ValueError:
        try:
            value = float(text)  # 1e9, 2.0
        except ValueError:
            value = None
        if value is None or (kind is int and not value.is_integer()):
            raise ValueError(f"{setting.name}={text!r} is not a valid {kind.__name__}") from None
        value = kind(value)
    if setting.minimum is not None and value < setting.minimum:
        raise ValueError(f"{setting.name}={text!r} must be at least {setting.minimum}")
    if setting.above is not None and value <= setting.above:
        raise ValueError(f"{setting.name}={text!r} must be above {setting.above}")
    if setting.maximum is not None and value > setting.maximum:
        raise ValueError(f"{setting.name}={text!r} must be at most {setting.maximum}")
    return value


def get(name: str):
    """The current value of setting ``name``, from the environment; ValueError if malformed."""
    return parse(SETTINGS[name], os.environ.get(name))


def is_set(name: str) -> bool:
    """Whether the variable is in the environment at all (set empty included)."""
    return name in os.environ


def validate() -> None:
    """Raise ValueError naming the variable if any setting in the environment is malformed."""
    for name in SETTINGS:
        get(name)


# -- writing --------------------------------------------------------------------------
def put(name: str, value) -> None:
    """Write setting ``name`` for this process and its children (None: remove it).

    Checked first: a malformed value raises and leaves the environment as it was."""
    setting = SETTINGS[name]
    if value is None:
        os.environ.pop(name, None)
        return
    if isinstance(value, bool):
        value = "1" if value else "0"
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if setting.kind == PATH and text:
        text = os.path.abspath(os.path.expanduser(text))  # children may change directory
    parse(setting, text)
    os.environ[name] = text


def snapshot() -> dict[str, str | None]:
    """Every setting as the environment holds it now, for :func:`restore`."""
    return {name: os.environ.get(name) for name in SETTINGS}


def restore(saved: dict[str, str | None]) -> None:
    """Put every setting back as :func:`snapshot` found it (None: not set)."""
    for name, text in saved.items():
        if text is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = text


# What wrote each setting in this process ("flag", "enable()"): where its value came from.
_written_by: dict[str, str] = {}


def write(source: str = "enable()", **settings) -> None:
    """Write the settings given (``timeout=5`` is ``SWIFT_SAFE_MEDIA_TIMEOUT``) over the
    environment, skipping those that are None: flag > environment > default. ``source``
    is what gave them, for :func:`origin`."""
    for key, value in settings.items():
        if value is not None:
            put(_by_key(key), value)
            _written_by[_by_key(key)] = source


def origin(name: str) -> str:
    """Where the value of setting ``name`` in effect came from: what wrote it in this
    process ("flag", "enable()"), else "environment" when it is set, else "default"."""
    if name in _written_by and is_set(name):
        return _written_by[name]
    return "environment" if is_set(name) else "default"


def _by_key(key: str) -> str:
    name = f"SWIFT_SAFE_MEDIA_{key.upper()}"
    if name not in SETTINGS:
        raise TypeError(f"unknown setting {key!r}")
    return name
