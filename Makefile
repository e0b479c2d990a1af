# `make test` and `make demo` set everything up on a fresh machine: FFmpeg's shared
# libraries and libseccomp2 (apt), then .venv/ with the pinned test environment; `make test` also builds
# .venv-lerobot/, LeRobot 0.4.4 with its own pins, and .venv-lerobot-0.6/, LeRobot 0.6.1 with its own
# pins on Python 3.12, where the real lerobot-train runs, and .venv-llamafactory/, LLaMA-Factory 0.9.5
# with its own pins, where the real llamafactory-cli train runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LEROBOT_VENV := .venv-lerobot
LEROBOT_PY := $(LEROBOT_VENV)/bin/python
LEROBOT_STAMP := $(LEROBOT_VENV)/.installed
LEROBOT06_VENV := .venv-lerobot-0.6
LEROBOT06_PY := $(LEROBOT06_VENV)/bin/python
LEROBOT06_STAMP := $(LEROBOT06_VENV)/.installed
LLAMAFACTORY_VENV := .venv-llamafactory
LLAMAFACTORY_PY := $(LLAMAFACTORY_VENV)/bin/python
LLAMAFACTORY_STAMP := $(LLAMAFACTORY_VENV)/.installed
# Other LeRobot releases, without their dependencies (0.6.1's serve them), each in a folder of
# its own under the 0.6 venv: tests/test_lerobot_versions.py runs the adapter against each.
LEROBOT_RELEASES := 0.5.0 0.5.1 0.6.0
# A Python 3.12 for LeRobot 0.5+ (PYTHON312=/path/to/python3.12 to choose one).
PYTHON312 ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: test envs demo bench dist ffmpeg build-tools python3.12 clean

# The four venvs build side by side (pip waits on the network more than on the CPU); apt runs
# first and once (ffmpeg, build-tools are order-only prerequisites of every venv).
ENVS := $(STAMP) $(LEROBOT_STAMP) $(LEROBOT06_STAMP) $(LLAMAFACTORY_STAMP)
# What each venv takes at least (GiB, measured: 7.6, 8.3, 5.5, 5.9), for tools/venv_space.py to stop
# before pip, not halfway, when the disk cannot hold the ones still missing; once built, their
# identical binaries (CUDA libraries, triton) are hard-linked between them: 27 GiB become 21.
VENV_GIB := $(VENV)=7 $(LEROBOT_VENV)=7.5 $(LEROBOT06_VENV)=5 $(LLAMAFACTORY_VENV)=5.3
VENVS_SHARED := $(VENV)/.shared
# pytest processes for the part of the suite that may run side by side (one file per process at
# a time); `make test TEST_JOBS=0` runs it in one process.
TEST_JOBS ?= 2

SOURCES := $(shell find swift_safe_media -name '*.py') _swift_safe_media_startup.py swift_safe_media.pth setup.py
# Our package as a user installs it: one wheel, built once from a clean build/ (setuptools
# would copy into the wheel whatever an earlier build left in build/lib, modules since moved
# included), then installed into each venv (four builds in one tree at once would race).
WHEEL_DIR := build/wheel
WHEEL := $(WHEEL_DIR)/.built

$(WHEEL): pyproject.toml MANIFEST.in $(SOURCES)
	rm -rf build swift_safe_media.egg-info
	$(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir $(WHEEL_DIR) .
	@touch $(WHEEL)

$(STAMP): requirements-test.txt $(WHEEL) | ffmpeg
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-test.txt
	@# LeRobot 0.4.4 pins torch<2.11: installed without its pins, its dataset deps are in requirements-test.txt.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps lerobot==0.4.4
	@# MiniCPM-o's utils pin librosa 0.9, moviepy 2.1 and pillow 10.4; what they import is pinned above.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps minicpmo-utils==1.0.7
	@# tests/test_preflight.py: a torchcodec built for another torch (2.10), kept aside, never imported here.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target $(VENV)/test-extras/torchcodec-0.10.0 torchcodec==0.10.0
	@# tests/test_preflight.py: PyPI's torchcodec 0.17 links CUDA 13; beside .venv-lerobot's torch (CUDA 12.8) it cannot load.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --upgrade --target $(VENV)/test-extras/torchcodec-0.17.0 torchcodec==0.17.0
	@# A regular install, not editable: the start-up hook (.pth) ships only in a wheel.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall $(WHEEL_DIR)/*.whl
	@touch $(STAMP)

# LeRobot's own environment, exactly as pip resolves `lerobot==0.4.4` (torch<2.11), with our
# package installed as a user installs it: a regular install, so the start-up hook ships.
$(LEROBOT_STAMP): requirements-lerobot.txt $(WHEEL) | ffmpeg build-tools
	@[ -x $(LEROBOT_PY) ] || $(PYTHON) -m venv $(LEROBOT_VENV)
	$(LEROBOT_PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-lerobot.txt
	$(LEROBOT_PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall $(WHEEL_DIR)/*.whl
	@# After our package: its own requirements must be met by the pins too.
	$(LEROBOT_PY) -m pip check
	@touch $(LEROBOT_STAMP)

# LeRobot 0.6.1's own environment on Python 3.12, exactly as pip resolves `lerobot[training]==0.6.1`,
# with our package installed as a user installs it, and the other releases' code beside it.
$(LEROBOT06_STAMP): requirements-lerobot-0.6.txt $(WHEEL) | ffmpeg build-tools
	@if [ ! -x $(LEROBOT06_PY) ]; then python312="$$($(MAKE) --no-print-directory -s python3.12)" && \
		"$$python312" -m venv $(LEROBOT06_VENV); fi
	$(LEROBOT06_PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-lerobot-0.6.txt
	$(LEROBOT06_PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall $(WHEEL_DIR)/*.whl
	$(LEROBOT06_PY) -m pip check
	@for release in $(LEROBOT_RELEASES); do [ -d $(LEROBOT06_VENV)/lerobot-releases/$$release/lerobot ] || \
		$(LEROBOT06_PY) -m pip install --quiet --disable-pip-version-check --no-deps \
			--target $(LEROBOT06_VENV)/lerobot-releases/$$release lerobot==$$release || exit 1; done
	@touch $(LEROBOT06_STAMP)

# LLaMA-Factory 0.9.5's own environment on Python 3.11, exactly as pip resolves `llamafactory==0.9.5`
# with torch 2.11 (torchaudio's last release), with our package installed as a user installs it.
$(LLAMAFACTORY_STAMP): requirements-llamafactory.txt $(WHEEL) | ffmpeg
	@[ -x $(LLAMAFACTORY_PY) ] || $(PYTHON) -m venv $(LLAMAFACTORY_VENV)
	$(LLAMAFACTORY_PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-llamafactory.txt
	$(LLAMAFACTORY_PY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall $(WHEEL_DIR)/*.whl
	$(LLAMAFACTORY_PY) -m pip check
	@# tests/test_llamafactory_map.py: datasets 4.8 on call the map's pool as mp.Pool (4.0-4.7 by a copied
	@# name); 5.2 kept aside (its other requirements are met by the pins above), first on the path of one run.
	$(LLAMAFACTORY_PY) -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
		--target $(LLAMAFACTORY_VENV)/test-extras/datasets-5.2.0 datasets==5.2.0
	@touch $(LLAMAFACTORY_STAMP)

# Prints the path of a Python 3.12: $(PYTHON312), python3.12 on PATH, pyenv's, uv's, or one
# apt installs (Debian 13 / Ubuntu 24.04 have it); else stops, saying how to get one.
python3.12:
	@for candidate in "$(PYTHON312)" python3.12 \
			$$(command -v pyenv >/dev/null && ls -d "$$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r) \
			$$(command -v uv >/dev/null && uv python find 3.12 2>/dev/null); do \
		[ -n "$$candidate" ] && "$$candidate" -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 12))' \
			2>/dev/null && { command -v "$$candidate"; exit 0; }; \
	done; \
	if command -v apt-get >/dev/null && { $(SUDO) apt-get update -qq >&2; apt-cache show python3.12-venv >/dev/null 2>&1; }; then \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq python3.12 python3.12-venv >&2 && \
		command -v python3.12 && exit 0; \
	fi; \
	echo "No Python 3.12 found (LeRobot 0.5+ needs it). Install one and run make again: \
	'pyenv install 3.12', 'uv python install 3.12', 'apt-get install python3.12 python3.12-venv' \
	(Debian 13, Ubuntu 24.04), or point PYTHON312=/path/to/python3.12 at one." >&2; exit 1

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

envs: $(ENVS)

$(VENVS_SHARED): $(ENVS)
	@$(PYTHON) tools/venv_space.py share $(VENV) $(LEROBOT_VENV) $(LEROBOT06_VENV) $(LLAMAFACTORY_VENV)
	@touch $(VENVS_SHARED)

# What the CPU gave at that moment, for reading a suite's time: the same machine has taken 3 s
# and 10-17 s for `import torch` within one hour, with nothing else running on it.
CPU_READING := $(PY) -c "import time; t = time.process_time(); import torch; \
	print(f'import torch took {time.process_time() - t:.1f} s of CPU')"
MAKE_STARTED := $(shell date +%s)
SINCE_STARTED := $$(( $$(date +%s) - $(MAKE_STARTED) )) s

# The suite in two parts: files side by side in TEST_JOBS processes, then the tests marked
# `serial` (they time a decode against the CPU it got, or look at every process's shared
# memory) alone. Both parts always run; the exit status is the first failure's. The log says
# how long the venvs and each part took, and a reading of the CPU before each part.
test:
	@$(PYTHON) tools/venv_space.py check $(VENV_GIB)
	@$(MAKE) --no-print-directory --output-sync=target -j4 envs
	@$(MAKE) --no-print-directory $(VENVS_SHARED)
	@echo "make test: venvs ready after $(SINCE_STARTED); $$($(CPU_READING))"; \
	status=0; \
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile -m "not serial" --durations=25 || status=$$?; \
	echo "make test: parallel part done after $(SINCE_STARTED); $$($(CPU_READING))"; \
	$(PY) -m pytest -m serial --durations=10 || status=$$?; \
	echo "make test: done after $(SINCE_STARTED)"; \
	exit $$status

demo: $(STAMP)
	$(PY) -m swift_safe_media.demo

bench: $(STAMP) $(LEROBOT_STAMP) $(LEROBOT06_STAMP) $(LLAMAFACTORY_STAMP)
	$(PY) bench/engine.py
	$(PY) bench/decoders.py
	$(PY) bench/scan.py
	$(PY) bench/swift_startup.py
	$(PY) bench/lerobot.py
	$(PY) bench/lerobot_train.py
	$(PY) bench/lerobot_train.py --policy act
	$(PY) bench/lerobot_train.py --lerobot 0.6 --policy act --workers 4

# The sdist and the wheel, as PyPI would get them, checked (tests/test_packaging.py does the same).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

clean:
	rm -rf $(VENV) $(LEROBOT_VENV) $(LEROBOT06_VENV) $(LLAMAFACTORY_VENV) dist

# `make newest`: release day for every dependency at once. One venv, .venv-newest/, on Python 3.12
# (LeRobot 0.5+ needs it), with the newest release of torch, torchvision, torchcodec, transformers,
# datasets, PyAV, numpy, our own dependencies, the test libraries of requirements-test.txt (pins
# taken off) and each host. The hosts cap their dependencies (ms-swift transformers<5.20, LeRobot
# torch<2.12, LLaMA-Factory transformers<=5.6 and datasets<=4.0, ...) and pip would honour the caps
# by going back to older releases: so the hosts go in with --no-deps, then what they require that is
# still missing, unpinned, the core held at its newest (-c core.txt). Left out: torchaudio (LLaMA-
# Factory imports it, but its last release refuses to load beside a newer torch) and gradio (LLaMA-
# Factory's web UI; it caps pillow). Kept at requirements-test.txt's pins, as test scaffolding:
# megatron-core and mcore-bridge (tests/megatron_shim.py fakes Transformer Engine as they read it),
# and moviepy, without its deps (its decorator<5 would take librosa back): ms-swift's stock Ovis
# loaders, a parity reference, import moviepy.editor, gone in moviepy 2. Then tools/newest.py runs
# the parity, hang and host-entry tests there and writes build/newest-report.md. Not part of
# `make test`; remove .venv-newest/ to take the releases out since it was built. pip reads no
# configuration file: the releases come from PyPI, as on a user's machine.
NEWEST_VENV := .venv-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_PIP := $(NEWEST_PY) -m pip --disable-pip-version-check
NEWEST_STAMP := $(NEWEST_VENV)/.installed
NEWEST_CORE := torch torchvision torchcodec transformers datasets av numpy pillow soundfile soxr tqdm
NEWEST_HOSTS := ms-swift lerobot llamafactory
NEWEST_HELD := megatron-core mcore-bridge
NEWEST_LEFT_OUT := torchaudio gradio
newest_or = $(subst $(eval) ,|,$(strip $(1)))

.PHONY: newest
newest $(NEWEST_STAMP): export PIP_CONFIG_FILE := /dev/null

$(NEWEST_STAMP): requirements-test.txt $(WHEEL) | ffmpeg build-tools
	@if [ ! -x $(NEWEST_PY) ]; then python312="$$($(MAKE) --no-print-directory -s python3.12)" && \
		"$$python312" -m venv $(NEWEST_VENV); fi
	$(NEWEST_PIP) install --quiet --upgrade pip
	$(NEWEST_PIP) install --quiet --upgrade $(NEWEST_CORE)
	$(NEWEST_PIP) freeze | grep -iE '^($(call newest_or,$(NEWEST_CORE)))==' > $(NEWEST_VENV)/core.txt
	sed -e 's/#.*//' -e 's/ //g' -e '/^$$/d' requirements-test.txt | grep -viE '^($(call newest_or,$(NEWEST_HOSTS)))==' \
		| grep -viE '^($(call newest_or,$(NEWEST_HELD) moviepy))==' | sed 's/[=<>!~].*//' > $(NEWEST_VENV)/test.txt
	grep -iE '^($(call newest_or,$(NEWEST_HELD)))==' requirements-test.txt >> $(NEWEST_VENV)/test.txt || true
	$(NEWEST_PIP) install --quiet --upgrade -c $(NEWEST_VENV)/core.txt -r $(NEWEST_VENV)/test.txt
	@# minicpmo-utils (the coverage tests) pins librosa, moviepy and pillow: without its deps too.
	$(NEWEST_PIP) install --quiet --upgrade --no-deps $(NEWEST_HOSTS) minicpmo-utils \
		$$(grep -i '^moviepy==' requirements-test.txt)
	missing="$$($(NEWEST_PIP) check | sed -n 's/.* requires \([^,]*\), which is not installed\.$$/\1/p' \
		| sort -u | grep -viE '^($(call newest_or,$(NEWEST_LEFT_OUT)))$$')"; \
		[ -z "$$missing" ] || $(NEWEST_PIP) install --quiet -c $(NEWEST_VENV)/core.txt $$missing
	$(NEWEST_PIP) install --quiet --no-deps --force-reinstall $(WHEEL_DIR)/*.whl
	@touch $(NEWEST_STAMP)

newest: $(NEWEST_STAMP)
	$(NEWEST_PY) tools/newest.py
