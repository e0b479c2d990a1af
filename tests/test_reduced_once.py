"""A tokenizer pickled for a loader's workers is reduced once per start (workers/reduced_once.py):
the same bytes as pickle writes without it, the state computed once, the table left as it was.
A real ``tokenizers.Tokenizer`` with Qwen2.5's vocabulary size; real workers."""

from __future__ import annotations

import copyreg
import json
import pickle
from multiprocessing import reduction

import pytest

from swift_safe_media.workers import reduced_once, spawn_guard

from .fresh import clean_environment, run_python

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer():
    from . import tiny_models

    return tiny_models._byte_level_tokenizer()


def test_each_pickler_writes_the_same_bytes_from_one_reduction(tokenizer):
    plain, forking = pickle.dumps(tokenizer), bytes(reduction.ForkingPickler.dumps(tokenizer))
    checked, _ = spawn_guard.pickle_noting_main(tokenizer)
    with reduced_once.reduced_once() as kept:
        assert copyreg.dispatch_table[tokenizers.Tokenizer] is kept
        within = [pickle.dumps(tokenizer), bytes(reduction.ForkingPickler.dumps(tokenizer)),
                  spawn_guard.pickle_noting_main(tokenizer)[0], pickle.dumps([tokenizer, tokenizer])]
    assert within[:3] == [plain, forking, checked]
    assert len(within[0]) > 3_000_000  # the vocabulary's JSON: what is worth computing once
    assert (kept.computed, kept.given) == (1, 3), vars(kept)  # the pair: pickle's own memo gives the second
    assert tokenizers.Tokenizer not in copyreg.dispatch_table
    again = pickle.loads(within[3])
    assert again[0] is again[1]
    assert again[0].encode("héllo wörld <tool_call>").ids == tokenizer.encode("héllo wörld <tool_call>").ids


def test_a_type_with_a_reducer_of_its_own_keeps_it(tokenizer):
    def own(obj):
        return tokenizers.Tokenizer.from_str, (obj.to_str(),)
    copyreg.pickle(tokenizers.Tokenizer, own)
    try:
        with reduced_once.reduced_once() as kept:
            assert copyreg.dispatch_table[tokenizers.Tokenizer] is own
            pickle.dumps(tokenizer)
        assert copyreg.dispatch_table[tokenizers.Tokenizer] is own and kept.computed == 0
    finally:
        del copyreg.dispatch_table[tokenizers.Tokenizer]


def test_distinct_tokenizers_are_reduced_each_for_itself(tokenizer):
    other = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    other.add_special_tokens(["<|only_in_the_other|>"])
    with reduced_once.reduced_once() as kept:
        first, second = pickle.loads(pickle.dumps(tokenizer)), pickle.loads(pickle.dumps(other))
    assert kept.computed == 2
    assert first.get_vocab_size() + 1 == second.get_vocab_size()


@pytest.mark.timeout(300)
def test_workers_from_the_warm_forkserver_encode_as_the_trainer_does():
    # Workers that are sent the tokenizer: no holding server unpickles it ahead for them (workers.held_arguments).
    env = clean_environment({"SWIFT_SAFE_MEDIA_WORKER_ARGUMENTS_AHEAD": "0"}, warm_start=True)
    done = run_python(module="tests.programs.tokenizer_workers", env=env,
                      timeout=240)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["context"] == "WarmForkServerContext", found
    assert [item["ids"] for item in found["items"]] == found["expected"]
    assert {item["ppid"] for item in found["items"]} == {found["forkserver"]}
    # The check's pickle and one a worker: computed once, given again for each worker.
    assert found["counts"]["computed"] == 1 and found["counts"]["given"] >= 2, found["counts"]
    assert found["table_restored"]
