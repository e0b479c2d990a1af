"""LLaMA-Factory's preprocessing maps (``preprocessing_num_workers: 2``) under protection: their
processes from the warm forkserver against the stock pool's forks of the trainer, in
alternating rounds (ABBA) in one protected process, LLaMA-Factory 0.9.5's own environment.

One round is LLaMA-Factory's ``get_dataset`` over a clean dataset of ``--rows`` rows (2 s
h264+aac clips as videos and 1 s tones as audios, the test scenario's media): its two
``Dataset.map`` calls with two processes each, the converter's and the tokenizer's (every
row's media decoded in a sandbox), and the JSON load. Each map's wall time is taken by
wrapping ``Dataset.map``; the side is chosen by ``SWIFT_SAFE_MEDIA_MP_CONTEXT`` (``forkserver``,
the default, or ``fork``, which keeps the stock pool), read as each pool is asked for.

    .venv-llamafactory/bin/python bench/llamafactory_map.py [--rounds 8] [--rows 48]
"""

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


# The top level only imports and defines: the warm forkserver imports this script once, as
# it imports a training script, instead of every map process importing it.


def main():
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # not bench/: its llamafactory.py
    from tests import llamafactory_scenario as scenario

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--rows", type=int, default=48)
    args = parser.parse_args()
    os.environ.update(scenario.OFFLINE)
    # One thread each, as the CLI tests run: with torch's OpenMP pool started in this process,
    # the stock pool's forks hang in libgomp's barrier (seen here: the reason for the forkserver).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = Path(tempfile.mkdtemp(prefix="bench_llamafactory_map_"))
    atexit.register(shutil.rmtree, folder, True)  # media, tiny model, datasets cache: 44 MB a run
    os.environ["HF_DATASETS_CACHE"] = str(folder / "datasets_cache")
    media = scenario.build_media(folder / "media")
    from tests import tiny_models

    model = tiny_models.build(str(folder / "tiny_qwen2_5_omni"))
    good = [path for name, path in sorted(media.items()) if name.startswith(("good_", "tone_"))]
    scenario.build_dataset(folder, [good[index % len(good)] for index in range(args.rows)], "bench")

    import llamafactory  # noqa: F401  (before enable(), as the CLI: the warm forkserver preloads its modules)
    import swift_safe_media
    from swift_safe_media import config

    swift_safe_media.enable()
    import datasets
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    settings = {key: value for key, value in (line.split(": ", 1) for line in scenario.yaml_text(
        model, str(folder), str(folder / "out"), dataset="bench").splitlines())}
    settings = {key: json.loads(value) for key, value in settings.items()}
    settings.update(preprocessing_num_workers=2, overwrite_cache=True)
    model_args, data_args, training_args, _, _ = get_train_args(settings)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)

    maps: list[float] = []
    stock_map = datasets.Dataset.map

    def timed_map(self, *map_args, **map_kwargs):
        started = time.perf_counter()
        try:
            return stock_map(self, *map_args, **map_kwargs)
        finally:
            if (map_kwargs.get("num_proc") or 1) > 1:
                maps.append(time.perf_counter() - started)

    datasets.Dataset.map = timed_map

    def one_round(method: str) -> tuple[float, list[float]]:
        config.put(config.MP_CONTEXT, method)
        maps.clear()
        started = time.perf_counter()
        module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
        assert len(module["train_dataset"]) == args.rows, module
        return time.perf_counter() - started, list(maps)

    one_round("forkserver"), one_round("fork")  # warm both paths (imports, caches)
    times: dict[str, list] = {"forkserver": [], "fork": []}
    for index in range(args.rounds):
        order = ("forkserver", "fork") if index % 4 in (0, 3) else ("fork", "forkserver")
        for method in order:
            times[method].append(one_round(method))
    for method, rounds in times.items():
        total = statistics.median(seconds for seconds, _ in rounds)
        per_map = [statistics.median(found[index] for _, found in rounds) for index in range(len(rounds[0][1]))]
        print(f"{method:10} get_dataset {total:.3f} s; each map with 2 processes: "
              + ", ".join(f"{seconds:.3f} s" for seconds in per_map))
    warm = [seconds for seconds, _ in times["forkserver"]]
    stock = [seconds for seconds, _ in times["fork"]]
    ratio = statistics.median(warm) / statistics.median(stock)
    print(f"ratio warm forkserver / stock fork (median get_dataset): {ratio:.3f}")
    pairs = [sum(w) / sum(s) for (_, w), (_, s) in zip(times["forkserver"], times["fork"])]
    print(f"ratio of the maps' wall time, median of {len(pairs)} paired rounds: {statistics.median(pairs):.3f} "
          f"(quartiles {', '.join(f'{q:.3f}' for q in statistics.quantiles(pairs, n=4))})")


if __name__ == "__main__":
    main()
