# `make test` and `make demo` set everything up on a fresh machine: FFmpeg's shared
# libraries (apt), then .venv/ with the pinned test environment.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: test demo bench ffmpeg clean

SOURCES := $(shell find swift_safe_media -name '*.py') _swift_safe_media_startup.py swift_safe_media.pth setup.py

$(STAMP): requirements-test.txt pyproject.toml $(SOURCES)
	@$(MAKE) --no-print-directory ffmpeg
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
	@# LeRobot 0.4.4 pins torch<2.11: installed without its pins, its dataset deps are in requirements-test.txt.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps lerobot==0.4.4
	@# A regular install, not editable: the start-up hook (.pth) ships only in a wheel.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall .
	@touch $(STAMP)

ffmpeg:
	@if ! command -v ffmpeg >/dev/null || ! ldconfig -p | grep -q 'libavcodec\.so'; then \
		echo "installing FFmpeg (apt)"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq ffmpeg >/dev/null; \
	fi

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) -m swift_safe_media.demo

bench: $(STAMP)
	$(PY) bench/engine.py
	$(PY) bench/decoders.py
	$(PY) bench/scan.py
	$(PY) bench/swift_startup.py
	$(PY) bench/lerobot.py

clean:
	rm -rf $(VENV)
