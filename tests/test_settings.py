"""Every ``SWIFT_SAFE_MEDIA*`` setting is declared once in ``config.py``: the table of
``docs/settings.md`` lists exactly those, each parses through the one parser, and ``enable()`` refuses
a malformed value of any of them, naming it, before anything is patched."""

from __future__ import annotations

import pathlib
import re

import pytest

import swift_safe_media
from swift_safe_media import config

SETTINGS_PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def documented_settings() -> list[str]:
    section = SETTINGS_PAGE.read_text().split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    return [match for line in section.splitlines() if line.startswith("| `")
            for match in re.findall(r"^\| `(SWIFT_SAFE_MEDIA\w*)`", line)]


def test_the_settings_page_lists_exactly_the_registry():
    listed = documented_settings()
    assert len(listed) == len(set(listed)), listed
    assert sorted(listed) == sorted(config.SETTINGS)


def test_every_setting_is_documented_and_typed():
    for setting in config.SETTINGS.values():
        assert setting.name.startswith("SWIFT_SAFE_MEDIA") and setting.doc, setting
        assert setting.kind in (config.FLOAT, config.INT, config.CHOICE, config.SWITCH,
                                config.TEXT, config.PATH, config.LIST), setting
        assert setting.kind != config.CHOICE or setting.choices, setting


CHECKED = [name for name, setting in config.SETTINGS.items()
           if setting.kind in (config.FLOAT, config.INT, config.CHOICE, config.SWITCH)]


@pytest.mark.parametrize("name", CHECKED)
def test_enable_refuses_a_malformed_value_naming_it(name, monkeypatch):
    monkeypatch.setenv(name, "not-a-value")
    with pytest.raises(ValueError, match=f"^{name}='not-a-value'"):
        swift_safe_media.enable()
    assert not swift_safe_media.is_enabled()


def test_numbers_parse_with_their_bounds(monkeypatch):
    monkeypatch.setenv(config.MAX_PIXELS, "2e6")
    assert config.get(config.MAX_PIXELS) == 2_000_000
    monkeypatch.setenv(config.THREADS, " 3 ")
    assert config.decoder_threads() == 3
    monkeypatch.setenv(config.THREADS, "2.5")
    with pytest.raises(ValueError, match="is not a valid int"):
        config.decoder_threads()
    monkeypatch.setenv(config.THREADS, "0")
    with pytest.raises(ValueError, match="must be at least 1"):
        config.decoder_threads()
    monkeypatch.setenv(config.MAX_AUDIO_SECONDS, "0")
    with pytest.raises(ValueError, match="must be above 0"):
        config.get(config.MAX_AUDIO_SECONDS)
    monkeypatch.setenv(config.MAX_FAILURE_FRACTION, "1.5")
    with pytest.raises(ValueError, match="must be at most 1.0"):
        config.get(config.MAX_FAILURE_FRACTION)
    monkeypatch.setenv(config.TIMEOUT, "")
    assert config.timeout() == config.DEFAULT_TIMEOUT_S  # empty: the default


def test_text_settings_tell_unset_from_empty(monkeypatch):
    monkeypatch.delenv(config.QUARANTINE, raising=False)
    monkeypatch.delenv(config.PRELOAD, raising=False)
    assert config.get(config.QUARANTINE) is None and not config.is_set(config.QUARANTINE)
    assert "torch" in config.preload_modules()
    monkeypatch.setenv(config.QUARANTINE, "")
    monkeypatch.setenv(config.PRELOAD, "")
    assert config.get(config.QUARANTINE) == "" and config.is_set(config.QUARANTINE)
    assert config.preload_modules() == []


def test_a_refused_write_leaves_the_environment_as_it_was(monkeypatch, tmp_path):
    monkeypatch.setenv(config.MP_CONTEXT, "fork")
    with pytest.raises(ValueError, match="SWIFT_SAFE_MEDIA_MP_CONTEXT='threads' must be one of"):
        config.write(mp_context="threads")
    assert config.mp_context() == "fork"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(config.QUARANTINE, raising=False)
    config.write(quarantine="run/q.jsonl")
    assert config.get(config.QUARANTINE) == str(tmp_path / "run" / "q.jsonl")  # workers may change directory


def test_switch_words(monkeypatch):
    for word, expected in [("1", True), ("Yes", True), ("off", False), ("FALSE", False)]:
        monkeypatch.setenv(config.ENABLED, word)
        assert config.enabled_by_environment() is expected
    monkeypatch.setenv(config.ENABLED, "maybe")
    assert config.enabled_by_environment() is None  # the start-up hook never breaks an interpreter
