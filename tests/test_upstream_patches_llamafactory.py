"""The LLaMA-Factory series in patches/llamafactory/0.9.5/ applies to the pristine PyPI sdist of
0.9.5, passes its own new test, and turns the repro that hangs stock (upstream_pr/llamafactory_repro.py)
into a bounded error naming the file. The host runs from its tree, first on PYTHONPATH, with
LLaMA-Factory's own environment (``.venv-llamafactory/``, built by ``make test``) and this
environment's pytest copied in (tests/test_upstream_patches.py has the helpers and the other series).
"""

import time

import pytest

from .test_upstream_patches import (HANG_BOUND_S, PATCHES, ROOT, Job, Series, _apply_series, _copy_pytest, _env,
                                    _files, _sdist)

PYTHON = ROOT / ".venv-llamafactory" / "bin" / "python"
SERIES = Series("llamafactory", "0.9.5", PATCHES / "llamafactory" / "0.9.5", str(PYTHON),
                ("tests/data/test_media_worker.py",), "src")
REPRO = ROOT / "upstream_pr" / "llamafactory_repro.py"

pytestmark = pytest.mark.skipif(not PYTHON.exists(), reason=f"{PYTHON} is missing: `make test` builds it")


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upstream_llamafactory")
    pristine, patched = _apply_series(SERIES, _sdist(SERIES, folder / "sdist"), folder / "tree")
    tools = _copy_pytest(folder / "pytest")
    python = str(PYTHON)
    jobs = {
        "tests": Job(folder, "tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                                       "--timeout=240", *SERIES.tests], patched, _env(patched / "src", tools)),
        "stock": Job(folder, "stock", [python, str(REPRO)], folder, _env(pristine / "src")),
        "patched": Job(folder, "patched", [python, str(REPRO), "--timeout", "3"], folder, _env(patched / "src")),
    }
    yield {"pristine": pristine, "patched": patched, "jobs": jobs}
    for job in jobs.values():
        job.kill()


@pytest.mark.timeout(600)
def test_the_series_applies_to_the_pristine_sdist_and_changes_only_what_it_names(upstream):
    expected = set()
    for patch in sorted(SERIES.patches.glob("*.patch")):
        text = patch.read_text()
        assert text.startswith("From ") and "Subject: [PATCH" in text, f"{patch.name}: not git format-patch"
        expected |= {line.split(" b/", 1)[1] for line in text.splitlines() if line.startswith("diff --git ")}
    before, after = _files(upstream["pristine"]), _files(upstream["patched"])
    changed = {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}
    assert changed == expected, changed ^ expected


@pytest.mark.timeout(600)
def test_the_series_own_test_passes(upstream):
    job = upstream["jobs"]["tests"]
    assert job.wait(540) == 0, job.output()[-3000:]
    assert "3 passed" in job.output(), job.output()[-3000:]


@pytest.mark.timeout(600)
def test_the_repro_hangs_stock_and_is_bounded_and_named_patched(upstream):
    stock, patched = upstream["jobs"]["stock"], upstream["jobs"]["patched"]
    started = stock.wait_for("READING", 240)
    assert patched.wait(300) == 0, patched.output()[-3000:]
    result = patched.result()
    assert result["error"] == "MediaDecodeTimeoutError" and "clip.wav" in result["message"], result
    assert result["elapsed_s"] < 60, result
    remaining = HANG_BOUND_S - (time.monotonic() - started)
    if remaining > 0:
        time.sleep(remaining)
    assert stock.process.poll() is None, f"stock returned:\n{stock.output()[-3000:]}"  # still blocked
    assert "RESULT" not in stock.output()
