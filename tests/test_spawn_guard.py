"""A training script without `if __name__ == "__main__":` that iterates a spawn or
forkserver DataLoader at module level hangs for ever in stock PyTorch (each child re-runs
the script). Under protection it must finish: that DataLoader forks, one warning names
the script and line. A guarded script keeps its start method. Real scripts, each run as
`python SCRIPT` with a bounded timeout."""

import os
import subprocess
import sys
import re
import textwrap

import pytest

pytest.importorskip("torch")

SCRIPT = """
    import os, sys
    import swift_safe_media
    swift_safe_media.enable()
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __init__(self):
            self.padding = bytes(1 << 20)  # more than a pipe holds, as a real dataset is
        def __len__(self):
            return 4
        def __getitem__(self, index):
            # Spawn and forkserver children run the script as __mp_main__; forked ones have the parent's.
            return int(sys.modules["__main__"].__name__ == "__mp_main__")

    def train():
        loader = DataLoader(Rows(), num_workers=2, multiprocessing_context={method!r})
        print("re-imported main:", sorted(int(batch) for batch in loader), flush=True)
"""


def run_script(tmp_path, body: str, method: str):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT.format(method=method)) + textwrap.dedent(body))
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=150, cwd=str(tmp_path))
    return script, done


@pytest.mark.timeout(200)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_unguarded_script_forks_with_one_warning_instead_of_hanging(tmp_path, method):
    script, done = run_script(tmp_path, """
        train()
        train()  # a second DataLoader at module level: no second warning
    """, method)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("re-imported main: [0, 0, 0, 0]") == 2  # forked workers
    warnings = [line for line in done.stderr.splitlines() if "outside `if __name__" in line]
    assert len(warnings) == 1, done.stderr[-3000:]
    line = script.read_text().splitlines().index("train()") + 1  # the first, at module level
    assert f"{script} starts DataLoader workers at line {line} outside" in warnings[0]
    assert f"{method} workers would run the script again" in warnings[0]


@pytest.mark.timeout(200)
def test_guarded_script_keeps_spawn(tmp_path):
    _, done = run_script(tmp_path, """
        if __name__ == "__main__":
            train()
    """, "spawn")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "re-imported main: [1, 1, 1, 1]" in done.stdout  # spawned workers
    assert "outside `if __name__" not in done.stderr


LEROBOT_SCRIPT = """
    import sys
    import swift_safe_media
    swift_safe_media.enable(hosts=["lerobot"])
    from lerobot.datasets.utils import cycle
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, index):
            return int(sys.modules["__main__"].__name__ == "__mp_main__")

    # No start method named: protection gives the loader LeRobot's cycle draws from its own.
    batches = cycle(DataLoader(Rows(), batch_size=4, num_workers=2))
    print("re-imported main:", sorted(int(row) for row in next(batches)), flush=True)
"""


@pytest.mark.timeout(200)
def test_unguarded_lerobot_script_drawing_through_cycle_forks_instead_of_crashing(tmp_path):
    """The start method LeRobot's adapter gives a loader drawn by ``cycle`` is chosen before
    the main-script check, so the check judges the method the workers really get (it was
    chosen after it once: forkserver workers re-ran the script and died)."""
    pytest.importorskip("lerobot")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LEROBOT_SCRIPT))
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=150, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "re-imported main: [0, 0, 0, 0]" in done.stdout  # forked workers
    line = script.read_text().splitlines().index(next(
        text for text in script.read_text().splitlines() if text.startswith("print("))) + 1
    assert f"{script} starts DataLoader workers at line {line} outside" in done.stderr, done.stderr[-3000:]
    assert "forkserver workers would run the script again" in done.stderr


ONLY_DEFINES = {
    "console script": """
        import re
        import sys
        from json.tool import main
        if __name__ == '__main__':
            sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
            sys.exit(main())
    """,
    "definitions": '''
        """Docstring."""
        from __future__ import annotations
        import logging
        from typing import TYPE_CHECKING
        try:
            import tomllib
        except ImportError:
            tomllib = None
        if TYPE_CHECKING:
            import torch
        log = logging.getLogger(__name__)
        STEPS: int = 10
        NAMES = ("a", "b")

        @staticmethod
        def helper(x=1):
            return x

        class Config:
            lr = 1e-3

        if __name__ == "__main__":
            helper()
    ''',
}
ONLY_DEFINES["paths, environment and logging"] = """
        import logging, os, sys, warnings
        from pathlib import Path
        ROOT = Path(__file__).resolve().parent
        sys.path.insert(0, str(ROOT))
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        CACHE = os.path.join(os.getenv("HOME", "/tmp"), "cache")
        warnings.filterwarnings("ignore")
        logging.basicConfig(level=logging.INFO)
        log = logging.getLogger(__name__)
        log.setLevel(logging.DEBUG)
"""
DOES_MORE = {
    "a call": "import torch\ntorch.cuda.is_available()\n",
    "a path made by a call that does more": "from pathlib import Path\nROOT = Path(download())\n",
    "training at the top": "def train():\n    pass\ntrain()\n",
    "an assignment that calls": "import json\nrows = json.loads('[1]')\n",
    "a test that calls": "import os\nif os.cpu_count():\n    import json\n",
    "code outside the guard's main branch": "def train():\n    pass\nif __name__ != '__main__':\n    train()\n",
    "a loop": "for step in range(3):\n    pass\n",
    "a with block": "with open(__file__):\n    pass\n",
}


@pytest.mark.parametrize("name", sorted(ONLY_DEFINES))
def test_a_script_that_only_imports_and_defines_is_recognised(tmp_path, name):
    from swift_safe_media.workers import spawn_guard

    script = tmp_path / f"{name.replace(' ', '_')}.py"
    script.write_text(textwrap.dedent(ONLY_DEFINES[name]))
    assert spawn_guard.only_imports_and_defines(str(script))


@pytest.mark.parametrize("name", sorted(DOES_MORE))
def test_a_script_that_does_more_than_define_is_not(tmp_path, name):
    from swift_safe_media.workers import spawn_guard

    script = tmp_path / f"{name.replace(' ', '_')}.py"
    script.write_text(DOES_MORE[name])
    assert not spawn_guard.only_imports_and_defines(str(script))
    assert not spawn_guard.only_imports_and_defines(str(tmp_path / "missing.py"))


# Every way a user runs Python (issue 43): the dataset defined in the main module, iterated by
# a DataLoader with 2 workers under enable(). A child of spawn or forkserver cannot import a
# main module that is no file (python -, python -c, IPython as in a notebook): those fork, as stock PyTorch does; a file,
# or a module run with -m, keeps the warm forkserver. The batches are stock's either way.
OWN_DATASET = """import os, sys
import torch
import swift_safe_media
from torch.utils.data import DataLoader, Dataset
class Squares(Dataset):
    def __len__(self):
        return 6
    def __getitem__(self, index):
        return torch.tensor([index * index, int(sys.modules["__main__"].__name__ == "__mp_main__")])

if __name__ == "__main__":
    if os.environ.get("PROTECTED") == "1":
        swift_safe_media.enable()
    loader = DataLoader(Squares(), batch_size=2, num_workers=2)
    print("BATCHES", [batch.tolist() for batch in loader], flush=True)

"""
IPYTHON = ["-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor"]
RUN_AS = {"file": lambda path: [str(path)], "module": lambda path: ["-m", path.stem],
          "-c": lambda path: ["-c", OWN_DATASET], "stdin": lambda path: ["-"], "ipython": lambda path: IPYTHON}


def _batches(tmp_path, mode: str, protected: bool):
    script = tmp_path / "own_dataset.py"
    script.write_text(OWN_DATASET)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SWIFT_SAFE_MEDIA")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), str(tmp_path)])
    env["PROTECTED"] = "1" if protected else "0"
    done = subprocess.run([sys.executable, *RUN_AS[mode](script)], input=OWN_DATASET if mode in ("stdin", "ipython")
                          else None, capture_output=True, text=True, env=env, timeout=150, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    return re.findall(r"BATCHES .*", done.stdout), done.stderr + done.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", list(RUN_AS))
def test_a_dataset_of_the_main_module_works_however_python_runs_it(tmp_path, mode):
    stock, _ = _batches(tmp_path, mode, protected=False)
    ours, stderr = _batches(tmp_path, mode, protected=True)
    # Stock forks: its workers see the parent's __main__ (the flag 0).
    assert stock == ["BATCHES [[[0, 0], [1, 0]], [[4, 0], [9, 0]], [[16, 0], [25, 0]]]"], stock
    forked = [line for line in stderr.splitlines() if "so this DataLoader forks its workers, as stock" in line]
    if mode == "ipython":  # IPython prints the log line after its prompt
        forked = [line[line.index("swift_safe_media:"):] for line in forked]
    if mode in ("file", "module"):  # from the warm forkserver: the children imported the script as __mp_main__
        assert ours == ["BATCHES [[[0, 1], [1, 1]], [[4, 1], [9, 1]], [[16, 1], [25, 1]]]"], ours
        assert not forked, stderr[-3000:]
    else:
        assert ours == stock and len(forked) == 1, stderr[-3000:]
        assert ("<stdin>, which a child cannot run" if mode == "stdin" else "defined in a main module without a file") \
            in forked[0]
