# `make test` and `make demo` set everything up on a fresh machine: FFmpeg's shared
# libraries and libseccomp2 (apt), then .venv/ with the pinned test environment; `make test` also builds
# .venv-lerobot/, LeRobot 0.4.4 with its own pins, where the real lerobot-train runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LEROBOT_VENV := .venv-lerobot
LEROBOT_PY := $(LEROBOT_VENV)/bin/python
LEROBOT_STAMP := $(LEROBOT_VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: test demo bench ffmpeg build-tools clean

SOURCES := $(shell find swift_safe_media -name '*.py') _swift_safe_media_startup.py swift_safe_media.pth setup.py

$(STAMP): requirements-test.txt pyproject.toml $(SOURCES)
	@$(MAKE) --no-print-directory ffmpeg
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
	@# LeRobot 0.4.4 pins torch<2.11: installed without its pins, its dataset deps are in requirements-test.txt.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps lerobot==0.4.4
	@# tests/test_preflight.py: a torchcodec built for another torch (2.10), kept aside, never imported here.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target $(VENV)/test-extras/torchcodec-0.10.0 torchcodec==0.10.0
	@# tests/test_preflight.py: PyPI's torchcodec 0.17 links CUDA 13; beside .venv-lerobot's torch (CUDA 12.8) it cannot load.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target $(VENV)/test-extras/torchcodec-0.17.0 torchcodec==0.17.0
	@# A regular install, not editable: the start-up hook (.pth) ships only in a wheel.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall .
	@touch $(STAMP)

# LeRobot's own environment, exactly as pip resolves `lerobot==0.4.4` (torch<2.11), with our
# package installed as a user installs it: a regular install, so the start-up hook ships.
$(LEROBOT_STAMP): requirements-lerobot.txt pyproject.toml $(SOURCES)
	@$(MAKE) --no-print-directory ffmpeg build-tools
	@[ -x $(LEROBOT_PY) ] || $(PYTHON) -m venv $(LEROBOT_VENV)
	$(LEROBOT_PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-lerobot.txt
	$(LEROBOT_PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall .
	@# After our package: its own requirements must be met by the pins too.
	$(LEROBOT_PY) -m pip check
	@touch $(LEROBOT_STAMP)

# evdev (LeRobot -> pynput) has no wheel: it builds with gcc against Python's headers.
build-tools:
	@if ! command -v gcc >/dev/null || ! $(PYTHON) -c "import os, sys, sysconfig; \
			sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then \
		echo "installing gcc and Python headers (apt)"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq gcc python3-dev >/dev/null; \
	fi

# libseccomp2 (on every Debian/Ubuntu system already) builds the sandboxes' seccomp filter.
ffmpeg:
	@if ! command -v ffmpeg >/dev/null || ! ldconfig -p | grep -q 'libavcodec\.so' || ! ldconfig -p | grep -q 'libseccomp\.so\.2'; then \
		echo "installing FFmpeg and libseccomp2 (apt)"; \
		$(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq ffmpeg libseccomp2 >/dev/null; \
	fi

test: $(STAMP) $(LEROBOT_STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) -m swift_safe_media.demo

bench: $(STAMP) $(LEROBOT_STAMP)
	$(PY) bench/engine.py
	$(PY) bench/decoders.py
	$(PY) bench/scan.py
	$(PY) bench/swift_startup.py
	$(PY) bench/lerobot.py
	$(PY) bench/lerobot_train.py
	$(PY) bench/lerobot_train.py --policy act

clean:
	rm -rf $(VENV) $(LEROBOT_VENV)
