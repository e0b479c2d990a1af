"""A training script without `if __name__ == "__main__":` that iterates a spawn or
forkserver DataLoader at module level hangs for ever in stock PyTorch (each child re-runs
the script). Under protection it must finish: that DataLoader forks, one warning names
the script and line. A guarded script keeps its start method. Real scripts, each run as
`python SCRIPT` with a bounded timeout."""

import os
import subprocess
import sys
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
