"""How a DataLoader's workers start is one decision (swift_safe_media/workers/start_method.py),
whose rules are one table in docs/how-it-works.md#how-workers-start: one test per row here
(``test_row_N_...``), each on the decision with the inputs that row reads, plus the inputs
gathered from real torch DataLoaders. The rows end to end, with real workers and real
scripts: tests/test_spawn_guard.py (row 6), tests/test_warm_start.py (rows 5 and 7),
tests/test_lerobot*.py, tests/test_swift_*.py and tests/test_llamafactory*.py (row 1)."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

from swift_safe_media.workers import start_method
from swift_safe_media.workers.start_method import StartInputs, decide

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TABLE_ROWS = 7


class Inputs:
    """The decision's inputs as given values; reading one that was not given fails the
    test, so each row's test also shows which inputs that row reads (and no more)."""

    def __init__(self, **given):
        self.given = given

    def __getattr__(self, name):
        if name == "given":
            raise AttributeError(name)
        if name not in self.given:
            raise AssertionError(f"the decision read {name!r}, which this row does not need")
        return self.given[name]


CHOSEN_AND_CHECKED = dict(main_would_rerun=None, main_unreachable=None)  # rows 6 and 7 read these


def test_row_1_a_hosts_preference_wins():
    decision = decide(Inputs(host_prefers="fork"))
    assert (decision.method, decision.rule, decision.writes, decision.warning) == ("fork", 1, True, None)
    # Even over a start method named on the loader (ms-swift's own, from the flag we set).
    decision = decide(Inputs(host_prefers="forkserver", named=True, current="spawn", forkserver_problem=None,
                             **CHOSEN_AND_CHECKED))
    assert (decision.method, decision.rule) == ("forkserver", 1)


def test_row_2_a_method_the_user_named_is_kept_and_not_written():
    decision = decide(Inputs(host_prefers=None, named=True, current="spawn", **CHOSEN_AND_CHECKED))
    assert (decision.method, decision.rule, decision.writes) == ("spawn", 2, False)


@pytest.mark.parametrize("configured", ["default", "fork"])
def test_row_3_a_configured_default_or_fork_leaves_the_platforms_default(configured):
    decision = decide(Inputs(host_prefers=None, named=False, configured=configured, current="fork"))
    assert (decision.method, decision.rule, decision.writes) == ("fork", 3, False)


def test_row_4_a_dataset_that_cannot_be_pickled_forks_with_a_warning_naming_it():
    decision = decide(Inputs(host_prefers=None, named=False, configured="forkserver",
                             unpicklable="PicklingError: Can't pickle <lambda>", dataset_type="Rows"))
    assert (decision.method, decision.rule, decision.writes) == ("fork", 4, True)
    name, message = decision.warning
    assert name == "Rows"
    assert "the DataLoader's dataset (Rows) cannot be pickled (PicklingError: Can't pickle <lambda>)" in message
    assert "instead of starting from the forkserver" in message


def test_row_5_otherwise_the_configured_method():
    decision = decide(Inputs(host_prefers=None, named=False, configured="spawn", unpicklable=None,
                             **CHOSEN_AND_CHECKED))
    assert (decision.method, decision.rule, decision.writes, decision.warning) == ("spawn", 5, True, None)
    decision = decide(Inputs(host_prefers=None, named=False, configured="forkserver", unpicklable=None,
                             forkserver_problem=None, **CHOSEN_AND_CHECKED))
    assert (decision.method, decision.rule) == ("forkserver", 5)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_row_6_workers_that_would_rerun_an_unguarded_script_fork_with_a_warning(method):
    decision = decide(Inputs(host_prefers=None, named=True, current=method,
                             main_would_rerun=("/data/train.py", 12)))
    assert (decision.method, decision.rule, decision.writes) == ("fork", 6, True)
    name, message = decision.warning
    assert name == "/data/train.py"
    assert "/data/train.py starts DataLoader workers at line 12 outside `if __name__" in message
    assert f"{method} workers would run the script again" in message
    # Forked workers re-run nothing: the script is not read.
    assert decide(Inputs(host_prefers="fork")).rule == 1


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_row_6_workers_that_could_not_import_the_main_module_fork_with_a_warning(method):
    why = "the main script is <stdin>, which a child cannot run"
    decision = decide(Inputs(host_prefers=None, named=True, current=method, main_would_rerun=None,
                             main_unreachable=why))
    assert (decision.method, decision.rule, decision.writes) == ("fork", 6, True)
    assert decision.warning == ("__main__", f"swift_safe_media: {why}, so this DataLoader forks its workers, as "
                                            f"stock PyTorch's do, instead of starting them by {method} "
                                            f"(decodes are still bounded)")


def test_row_7_a_forkserver_with_threads_means_spawned_workers_with_a_warning():
    decision = decide(Inputs(host_prefers=None, named=False, configured="forkserver", unpicklable=None,
                             main_would_rerun=None, main_unreachable=None,
                             forkserver_problem="the warm forkserver has 2 threads"))
    assert (decision.method, decision.rule, decision.writes) == ("spawn", 7, True)
    assert decision.warning == ("forkserver", "swift_safe_media: the warm forkserver has 2 threads; "
                                              "DataLoader workers are spawned instead")
    # Only the forkserver is asked about: spawn never waits for its report.
    assert decide(Inputs(host_prefers="spawn", main_would_rerun=None, main_unreachable=None)).method == "spawn"


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return index


@pytest.fixture
def no_user_start_method(monkeypatch):
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: None)


def test_the_inputs_of_a_real_loader(monkeypatch, no_user_start_method):
    monkeypatch.delenv("SWIFT_SAFE_MEDIA_MP_CONTEXT", raising=False)
    loader = DataLoader(Rows(), num_workers=2)
    inputs = StartInputs(loader)
    assert (inputs.host_prefers, inputs.named, inputs.configured, inputs.unpicklable) == (None, False, "forkserver",
                                                                                        None)
    assert inputs.main_would_rerun is None  # pytest's own main module is not a script of ours

    named = StartInputs(DataLoader(Rows(), num_workers=2, multiprocessing_context="spawn"))
    assert named.named and named.current == "spawn"

    unpicklable = StartInputs(DataLoader(Rows(), num_workers=2, collate_fn=lambda batch: batch))
    assert unpicklable.unpicklable.startswith(("PicklingError", "AttributeError")) and unpicklable.dataset_type == "Rows"

    monkeypatch.setenv("SWIFT_SAFE_MEDIA_MP_CONTEXT", "default")
    assert StartInputs(loader).configured == "default"


class CollatorHoldingAModel:
    """As LLaMA-Factory's collators do: the model, and an array of its own."""

    def __init__(self):
        import numpy

        self.model = torch.nn.Linear(1024, 1024)  # 4 MiB of parameters
        self.table = numpy.ones((4, 1024, 1024), dtype=numpy.float64)  # 32 MiB

    def __call__(self, batch):
        return batch


class Split:
    """A tokenizer's pre-tokenizer written in Python: such a tokenizer cannot be pickled."""

    def pre_tokenize(self, pretokenized):
        pretokenized.split(lambda index, piece: [piece])


def test_the_start_check_writes_stand_ins_for_tensors_and_arrays(monkeypatch, no_user_start_method):
    """Rows 4 and 6 pickle the dataset and collator: a copy of a 64 MiB tensor, a model's
    weights or an array there is memory and time the trainer spends at each start of its
    workers. They are stand-ins; what the check learns is kept."""
    import pickle

    import tokenizers
    from torch.utils.data import TensorDataset

    from swift_safe_media.workers import spawn_guard

    dataset, collator = TensorDataset(torch.zeros(16, 1024, 1024)), CollatorHoldingAModel()
    inputs = StartInputs(DataLoader(dataset, num_workers=2, collate_fn=collator))
    assert inputs.unpicklable is None and inputs.main_names == frozenset()
    as_stock_pickles = len(pickle.dumps((dataset, collator, None)))
    assert as_stock_pickles > 100 * 2**20  # the tensor, the weights, the array
    assert len(inputs.pickled) < 64 * 1024, len(inputs.pickled)

    # A class of __main__ is still noted beside them, and still found in the bytes.
    held = type("Held", (), {"__module__": "__main__"})
    monkeypatch.setattr(sys.modules["__main__"], "Held", held, raising=False)
    holder = held()
    holder.weights = torch.ones(1024, 1024)
    pickled, names = spawn_guard.pickle_noting_main(holder)
    assert names == {"Held"} and spawn_guard._names_main(pickled) and len(pickled) < 4096

    # A tensor carrying attributes is pickled with them (its storage still stands in).
    tagged = torch.ones(1024, 1024)
    tagged.source = held()
    pickled, names = spawn_guard.pickle_noting_main(tagged)
    assert names == {"Held"} and len(pickled) < 4096

    # A tokenizer is pickled as it is: one that cannot be is still found out.
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"word": 0}, unk_token="word"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.PreTokenizer.custom(Split())
    collator.tokenizer = tokenizer
    refused = StartInputs(DataLoader(dataset, num_workers=2, collate_fn=collator))
    assert "cannot be serialized" in refused.unpicklable


def test_apply_writes_once_and_warns_once(caplog, no_user_start_method):
    context = torch.multiprocessing.get_context("spawn")
    loader = DataLoader(Rows(), num_workers=2, multiprocessing_context=context)
    start_method.apply(loader, start_method.Decision("spawn", 2))
    assert loader.multiprocessing_context is context  # kept: the user's own object
    warning = ("test-apply-" + str(id(loader)), "swift_safe_media: one warning")
    for _ in range(2):
        start_method.apply(loader, start_method.Decision("fork", 4, warning))
    assert loader.multiprocessing_context.get_start_method() == "fork"
    assert [record.getMessage() for record in caplog.records].count("swift_safe_media: one warning") == 1


def test_the_docs_table_the_code_and_these_tests_have_the_same_rows():
    doc = (ROOT / "docs" / "how-it-works.md").read_text().split("\n## How workers start\n", 1)[1]
    doc_rows = [int(match) for match in re.findall(r"^\| (\d+) \|", doc.split("\n## ", 1)[0], re.MULTILINE)]
    code_rows = [int(match) for match in re.findall(r"^(\d+)\. ", start_method.__doc__, re.MULTILINE)]
    tested = sorted({int(name.split("_")[2]) for name in globals() if re.match(r"test_row_\d+_", name)})
    assert doc_rows == code_rows == tested == list(range(1, TABLE_ROWS + 1))



DISABLE_RESTORES = """
import json
import swift_safe_media
from swift_safe_media.patching.targets import original_of
TORCH_FIRST = {torch_first}
if TORCH_FIRST:
    from torch.utils.data import dataloader
    stock = {{cls: dict(vars(cls)) for cls in (dataloader.DataLoader, dataloader._BaseDataLoaderIter)}}
swift_safe_media.enable()
import torch.utils.data
from torch.utils.data import dataloader
classes = (dataloader.DataLoader, dataloader._BaseDataLoaderIter)
def ours():
    return sorted(f"{{cls.__name__}}.{{name}}" for cls in classes for name, value in vars(cls).items()
                  if original_of(value) is not None)
found = {{"enabled": ours()}}
swift_safe_media.disable()
found["disabled"] = ours()
swift_safe_media.enable()
found["enabled again"] = ours()
swift_safe_media.disable()
found["disabled again"] = ours()
found["as before"] = all(dict(vars(cls)) == stock[cls] for cls in classes) if TORCH_FIRST else None
found["stock class"] = torch.utils.data.DataLoader is dataloader.DataLoader
found["batches"] = [int(batch) for batch in torch.utils.data.DataLoader(list(range(3)), batch_size=1)]
print(json.dumps(found))
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("torch_first", [True, False])
def test_disable_gives_torchs_dataloader_back_as_it_was(torch_first):
    """Every row of torch's target table (patching/torch_dataloader.py) is patched by enable(),
    whether torch's DataLoader was imported before or after it, and restored by disable():
    torch.utils.data.DataLoader and its iterator are torch's own objects again."""
    import json

    from tests.fresh import clean_environment, run_python

    env = clean_environment({"SWIFT_SAFE_MEDIA_STALL_TIMEOUT": "30"})
    done = run_python(code=DISABLE_RESTORES.format(torch_first=torch_first), env=env, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    patched = ["DataLoader.__init__", "DataLoader._get_iterator", "_BaseDataLoaderIter.__next__"]
    assert found["enabled"] == found["enabled again"] == patched
    assert found["disabled"] == found["disabled again"] == []
    assert found["as before"] in ((True,) if torch_first else (None,))
    assert found["stock class"] and found["batches"] == [0, 1, 2]
