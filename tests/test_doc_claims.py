"""No claim of the README stronger than its tests, and one home for its figures (issue 46,
items 1 and 2).

- Each README sentence (a table row counts as one) that says every, no, never, nothing,
  always or bit for bit is listed in ``CLAIMS`` below, with the tests that back it and the
  words of the sentence that name its exceptions or link to where they are listed (or, after
  ``none:``, why it has none). A new such sentence fails here until it is listed; a listed
  one that is gone fails too; a backing test must exist in ``tests/`` by that name.
- docs/engine.md's such sentences are listed the same way in ``ENGINE_CLAIMS`` (docs/never-silent.md's,
  47 of them, are not listed yet).
- The README's "Figures" table is docs/figures.md's "Headline figures" table, row for row, and
  each ratio and millisecond figure of that table is one of the sections below it there.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ENGINE = ROOT / "docs" / "engine.md"
FIGURES = ROOT / "docs" / "figures.md"
ABSOLUTE = re.compile(r"\b(every|no|never|nothing|always|bit for bit)\b", re.IGNORECASE)

CLAIMS = {
    "swift-safe-media makes media decoding in ms-swift, LeRobot and LLaMA-Factory (the *hosts*) **bounded, "
    "isolated and recoverable**: the decodes it covers run in a *sandbox* process with a hard timeout, *confined* "
    "(no network, no programs, no file writes, except where [confinement](docs/how-it-works.md#confinement) lists); "
    "a bad sample is replaced or its row dropped ([per host](docs/settings.md#per-host)), with the same batch count "
    "on each rank; and the log names the file and the reason.": {
        "exceptions": "except where [confinement](docs/how-it-works.md#confinement) lists",
        "tests": ["tests/test_engine.py::test_native_call_holding_the_gil_times_out",
                  "tests/test_confine_attack.py::test_tcp_connect_to_a_live_listener_reaches_nothing",
                  "tests/test_confine_attack.py::test_no_program_runs",
                  "tests/test_confine_attack.py::test_file_changes_are_refused",
                  "tests/test_confine_stock.py::test_stock_code_behind_the_entry_points_is_confined_and_still_decodes",
                  "tests/test_confine_stock.py::test_a_sandbox_that_runs_ffmpeg_runs_it_and_stays_confined",
                  "tests/test_confine_stock.py::test_a_downloads_sandbox_reaches_the_network_and_nothing_else",
                  "tests/test_swift_e2e.py::test_under_torchrun_the_ranks_stay_in_step_around_a_bad_clip",
                  "tests/test_run_modes.py::"
                  "test_a_stalled_decode_on_one_torchrun_rank_is_bounded_named_and_the_ranks_keep_step",
                  "tests/test_lerobot.py::test_protected_epoch_substitutes_bad_episodes_and_keeps_the_batch_count",
                  "tests/test_llamafactory_train.py::test_protected_llamafactory_train_drops_every_bad_row_and_names_it"],
    },
    "The media reads of LLaMA-Factory's `mm_plugin` (images, PyAV video, torchaudio audio, the Qwen video metadata, "
    "in each plugin that reads media) run LLaMA-Factory's own code in a sandbox, so outputs are stock's bit for bit "
    "(checked plugin by plugin in `tests/test_llamafactory_parity.py`).": {
        "exceptions": "none: the sandbox runs LLaMA-Factory's own reading code unchanged, so nothing differs; "
                      "the parity test compares each plugin's outputs",
        "tests": ["tests/test_llamafactory_parity.py::test_every_llamafactory_media_read_is_stock_bit_for_bit"],
    },
    "**Decoding** moves into sandbox processes (one kept per DataLoader worker; where stock code opens its file by "
    "name, its caller answers those opens, or on kernels before 5.14 it gets one per call), forked in milliseconds from a clean zygote and confined: no network, no exec, no file writes, reads limited to the media handed to it, no token of "
    "the trainer's environment, output and replies that cannot reach the trainer.": {
        "exceptions": "none here: the next sentence lists them (\"The exceptions, listed in [confinement]\")",
        "tests": ["tests/test_confine_attack.py::test_network_sockets_cannot_be_opened",
                  "tests/test_confine_attack.py::test_no_program_runs",
                  "tests/test_confine_attack.py::test_file_changes_are_refused",
                  "tests/test_confine_attack.py::test_read_roots_limit_reads",
                  "tests/test_confine_secrets.py::test_zygote_and_sandbox_hold_no_token",
                  "tests/test_confine_secrets.py::test_what_a_failed_call_printed_comes_back_escaped_and_capped_in_its_error",
                  "tests/test_reply_unpickler.py::test_a_crafted_reply_is_refused_and_runs_nothing_in_the_caller",
                  "tests/test_engine.py::test_dataloader_workers_each_get_a_sandbox",
                  "tests/test_confine_stock.py::test_a_call_by_name_reads_its_own_file_and_nothing_else",
                  "tests/test_confine_stock.py::test_every_kind_of_sandbox_forks_from_one_zygote",
                  "tests/test_open_broker.py::test_attacks_are_refused_in_a_sandbox_that_served_calls_before"],
    },
    "The loaders are replaced by twins (torchcodec, PyAV, soundfile; not decord or audioread) with stock's frames "
    "and samples, bit for bit, except where [docs/media-parity.md](docs/media-parity.md) says; the other decodes a "
    "template reaches run stock's own function in a sandbox "
    "([coverage table](docs/ms-swift.md#what-every-template-decodes-through)).": {
        "exceptions": "except where [docs/media-parity.md](docs/media-parity.md) says",
        "tests": ["tests/test_decoders_parity.py::test_swift_video_loader_matches_stock",
                  "tests/test_decoders_parity.py::test_load_audio_matches_stock",
                  "tests/test_decoders_parity.py::test_qwen_fetch_video_matches_stock",
                  "tests/test_confine_stock.py::test_stock_code_behind_the_entry_points_is_confined_and_still_decodes"],
    },
    "**Machine faults are not the file's:** a sandbox killed from outside or by the OOM killer, a zygote gone, a "
    "busy CPU or an unwritable registry is retried and not quarantined, and a killed DataLoader worker is replaced; "
    "when the retries run out, the sample is skipped, and where that ends a run is listed in "
    "[never-silent.md](docs/never-silent.md#machine-faults).": {
        "exceptions": "where that ends a run is listed in [never-silent.md](docs/never-silent.md#machine-faults)",
        "tests": ["tests/test_machine_faults.py::test_a_sandbox_killed_from_outside_mid_decode_is_retried_not_quarantined",
                  "tests/test_machine_faults.py::test_the_zygote_killed_mid_decode_is_replaced_and_the_decode_retried",
                  "tests/test_machine_faults_oom.py::test_the_oom_killer_takes_the_sandbox_and_the_decode_is_retried_not_lost",
                  "tests/test_machine_faults.py::test_oversubscribed_cpus_make_valid_decodes_slower_never_refused",
                  "tests/test_machine_faults.py::test_a_registry_in_a_read_only_folder_costs_no_valid_sample",
                  "tests/test_machine_faults.py::"
                  "test_machine_faults_that_outlast_the_retries_skip_the_sample_and_never_quarantine",
                  "tests/test_machine_faults.py::test_a_dataloader_worker_killed_mid_decode_leaves_no_sandbox_and_no_record"],
    },
    "A stall watchdog (`--safe_media_stall_timeout`) dumps what is in flight when no batch comes; an error budget "
    "stops a run whose data is mostly bad; `swift-safe-media scan DATASET` checks data before training; a release "
    "that moves a patched function is named at start-up ([never-silent](docs/never-silent.md)).": {
        "exceptions": "none: \"no batch comes\" is the watchdog's trigger (for the configured seconds), not a claim",
        "tests": ["tests/test_watchdog.py::test_stall_dumps_every_process_then_aborts",
                  "tests/test_budget.py::test_consecutive_failures_stop_at_the_limit_and_successes_reset_the_count",
                  "tests/test_scan.py::test_scan_finds_exactly_the_planted_bad_files",
                  "tests/test_moved_targets.py::test_llamafactory_with_a_media_read_renamed_is_named"],
    },
    "[Never silent](docs/never-silent.md): registry, watchdog, budget, summary, distributed runs, scan.": {
        "exceptions": "none: the title of a page, whose claims are its own",
        "tests": ["tests/test_docs.py::test_every_relative_link_and_anchor_resolves"],
    },
}

# docs/engine.md, as CLAIMS for the README.
ENGINE_CLAIMS = {
    "Errors: `MediaDecodeError` (base; `.path`, `.reason`, `.elapsed`, message starts with the path), "
    "`MediaDecodeTimeout` (overran; the sandbox's process group got SIGKILL), `MediaDecodeCrash` (the sandbox died; "
    "signal or exit code in the reason), `MediaQuarantined` (reserved for the quarantine registry), "
    "`MediaMachineFault` (not the file's fault: the machine retries ran out, `.fault == \"machine\"`; see "
    "[never silent](never-silent.md#machine-faults)).": {
        "exceptions": "none: \"never\" is the title of the page it links to, not a claim",
        "tests": ["tests/test_engine.py::test_errors_carry_path_reason_and_pickle",
                  "tests/test_engine.py::test_native_call_holding_the_gil_times_out",
                  "tests/test_engine.py::test_segfault_is_a_crash"],
    },
    "`SWIFT_SAFE_MEDIA_READ_ROOTS=/data`: every confined sandbox may read beneath `/data`.": {
        "exceptions": "none: a setting that widens reads, with no exception to it",
        "tests": ["tests/test_confine_attack.py::test_read_roots_limit_reads",
                  "tests/test_confine_stock.py::"
                  "test_files_beneath_the_read_roots_use_the_pooled_confined_sandbox"],
    },
    "`confine=False`: an unconfined sandbox (network, programs, writes, reads), still bounded by the timeout and "
    "the memory cap; `SWIFT_SAFE_MEDIA_CONFINE=0` for every sandbox.": {
        "exceptions": "none: \"every sandbox\" is what the setting turns off confinement for, without exception",
        "tests": ["tests/test_confine_attack.py::test_per_function_opt_out_runs_unconfined",
                  "tests/test_confine_attack.py::test_confine_0_really_turns_it_off",
                  "tests/test_engine.py::test_helper_programs_die_with_an_unconfined_sandbox"],
    },
    "`enable()` with no host (no ms-swift, no LeRobot) protects what a training script of your own calls:": {
        "exceptions": "none here: the list that follows it says what is protected, and the section below it "
                      "what is not",
        "tests": ["tests/test_coverage.py::test_a_plain_pytorch_script_is_protected"],
    },
    "Your `__getitem__` catches it and skips the sample as for any decode error (one you let through reaches your "
    "training loop as the `MediaDecodeError` itself, with `.path`, the worker's traceback as a note; stock torch "
    "would make it a `RuntimeError` of its text), or wrap the dataset: "
    "`ssm.skip_bad_samples(dataset)` replaces a sample whose decode raises `MediaDecodeError` by another one chosen "
    "from its index alone (the same on every rank and worker; the epoch keeps its length), with one log line naming "
    "the file.": {
        "exceptions": "none: the substitute is a function of the index alone, so it is the same wherever it runs",
        "tests": ["tests/test_own_decoders_bounded.py::test_skip_bad_samples_replaces_the_sample_the_same_way_everywhere",
                  "tests/test_own_decoders_bounded.py::"
                  "test_an_error_the_dataset_lets_through_reaches_the_training_loop_as_itself"],
    },
    "`confine=ssm.BY_NAME` (`@ssm.isolated(timeout=30, confine=ssm.BY_NAME)`): the call may also open its own files "
    "by name (the path argument, `path=`), and no other media.": {
        "exceptions": "none: other files by name are refused whichever way the sandbox is had (brokered or one per "
                      "call); files beneath SWIFT_SAFE_MEDIA_READ_ROOTS are the documented widening, next in the list",
        "tests": ["tests/test_confine_stock.py::test_a_call_by_name_reads_its_own_file_and_nothing_else",
                  "tests/test_open_broker.py::test_one_sandbox_serves_calls_on_other_files_each_reading_only_its_own"],
    },
    "Nothing here confines the decode: a hostile file can reach what the worker can; "
    "`@ssm.isolated(confine=ssm.BY_NAME)` confines.": {
        "exceptions": "none: a statement of what is not done, and the way to get it",
        "tests": ["tests/test_own_decoders_bounded.py::test_a_hang_in_a_workers_own_decode_is_ended_named_and_skipped",
                  "tests/test_confine_stock.py::test_a_call_by_name_reads_its_own_file_and_nothing_else"],
    },
}


def readme_sentences(text: str) -> list[str]:
    """The README's prose, one sentence at a time (a paragraph or a list item split at '. ',
    '! ', '? '), and each table row and heading whole; fenced code is left out."""
    units, paragraph, fenced = [], [], False

    def flush():
        if paragraph:
            joined = re.sub(r"^- ", "", " ".join(line.strip() for line in paragraph))
            units.extend(part.strip() for part in re.split(r"(?<=[.!?])\s+(?=\S)", joined) if part.strip())
            paragraph.clear()

    for line in text.splitlines():
        if line.strip().startswith("```"):
            flush()
            fenced = not fenced
        elif fenced:
            continue
        elif not line.strip() or line.startswith(("#", "|")):
            flush()
            if line.startswith("#") or (line.startswith("|") and not re.match(r"^\|[-| :]+\|$", line)):
                units.append(line.strip())
        else:
            if line.startswith("- "):
                flush()
            paragraph.append(line)
    flush()
    return units


def absolute_sentences() -> list[str]:
    return [unit for unit in readme_sentences(README.read_text()) if says_absolute(unit)]


def says_absolute(unit: str) -> bool:
    """Whether the words of a sentence (not its code spans or link targets) say every, no, ..."""
    return bool(ABSOLUTE.search(re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", unit))))


@lru_cache(maxsize=None)
def names_of_tests(path: str) -> frozenset:
    tree = ast.parse((ROOT / path).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
    return frozenset(names)


def test_every_absolute_readme_sentence_is_listed_with_its_backing():
    found = absolute_sentences()
    new = [sentence for sentence in found if sentence not in CLAIMS]
    gone = [sentence for sentence in CLAIMS if sentence not in found]
    assert not new, ("README sentences that say every/no/never/nothing/always/bit for bit and are not in "
                     "tests/test_doc_claims.py's CLAIMS (name their exceptions, then list them with their tests):\n"
                     + "\n".join(new))
    assert not gone, "CLAIMS lists sentences the README no longer has:\n" + "\n".join(gone)


def test_every_absolute_sentence_of_the_engine_page_is_listed_with_its_backing():
    found = [unit for unit in readme_sentences(ENGINE.read_text()) if says_absolute(unit)]
    new = [sentence for sentence in found if sentence not in ENGINE_CLAIMS]
    gone = [sentence for sentence in ENGINE_CLAIMS if sentence not in found]
    assert not new, ("docs/engine.md sentences that say every/no/never/nothing/always/bit for bit and are not in "
                     "tests/test_doc_claims.py's ENGINE_CLAIMS (name their exceptions, then list them with their "
                     "tests):\n" + "\n".join(new))
    assert not gone, "ENGINE_CLAIMS lists sentences docs/engine.md no longer has:\n" + "\n".join(gone)


@pytest.mark.parametrize("sentence", [*CLAIMS, *ENGINE_CLAIMS], ids=lambda sentence: sentence[:60])
def test_each_listed_claim_names_its_exceptions_and_its_tests_exist(sentence):
    claim = CLAIMS.get(sentence) or ENGINE_CLAIMS[sentence]
    exceptions = claim["exceptions"]
    assert exceptions.startswith("none") or exceptions in sentence, (
        f"the words naming the exceptions are not in the sentence: {exceptions!r}")
    assert exceptions.startswith("none") or "[" in exceptions or re.search(r"\b(except|unless|where)\b", exceptions), \
        exceptions
    assert claim["tests"], "a claim with no backing test"
    for test in claim["tests"]:
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), f"{test}: no such file"
        assert name in names_of_tests(path), f"{test}: no such test in {path}"


def test_the_sentence_splitter_and_the_word_rule():
    units = readme_sentences("Intro one. Every clip works!\n\n- a list item never fails\n\n```\nno code\n```\n"
                             "| no | row |\n|---|---|\n# Nothing heading\n")
    assert units == ["Intro one.", "Every clip works!", "a list item never fails", "| no | row |", "# Nothing heading"]
    assert [unit for unit in units if says_absolute(unit)] == units[1:]
    assert not says_absolute("nowhere, nobody, knowing, everyone, `no code`, [a link](page.md#every-row)")
    assert says_absolute("[every link text](page.md)") and says_absolute("stock's frames, Bit For Bit")


def table_rows(text: str, heading: str) -> list[str]:
    section = text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("|")]


def test_the_readme_figures_are_the_headline_table_of_docs_figures():
    readme, figures = table_rows(README.read_text(), "## Figures"), table_rows(FIGURES.read_text(), "## Headline figures")
    assert len(readme) >= 3, readme
    assert readme == figures, ("README.md's Figures table and docs/figures.md's Headline figures differ:\n"
                               + "\n".join(f"README:  {a}\nfigures: {b}" for a, b in zip(readme, figures) if a != b)
                               + f"\n({len(readme)} vs {len(figures)} rows)")


def headline_figures(cell: str) -> list[str]:
    """The ratios (``1.04x``; a range ``0.87-0.91x`` as its two ends) and milliseconds of a cell."""
    ends = [f"{end}x" for pair in re.findall(r"(\d+\.\d+)-(\d+\.\d+)x", cell) for end in pair]
    rest = re.sub(r"(\d+\.\d+)-(\d+\.\d+)x", "", cell)
    return ends + re.findall(r"\d+\.\d+x", rest) + re.findall(r"[+]?\d+\.\d+ ms", rest)


def test_each_headline_figure_is_one_of_the_record_below_it():
    """The headline table copies figures from the sections of docs/figures.md; it makes none up."""
    text = FIGURES.read_text()
    headline = text.split("\n## Headline figures\n", 1)[1].split("\n## ", 1)[0]
    record = text.replace(headline, "")
    rows = [row for row in table_rows(text, "## Headline figures")[2:]]
    assert rows and headline_figures("0.87-0.91x / 1.06x (+0.6 s); +2.0 ms") == ["0.87x", "0.91x", "1.06x", "+2.0 ms"]
    orphans = [(row.split("|")[1].strip(), figure) for row in rows for figure in headline_figures(row.split("|")[2])
               if figure not in record]
    assert not orphans, f"headline figures found nowhere in the sections of docs/figures.md: {orphans}"
