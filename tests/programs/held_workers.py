"""DataLoaders whose dataset and ``collate_fn`` share a real fast tokenizer (``tests.tiny_models``),
2 workers started from the warm forkserver under ``enable()``, each case with a holding server
(``workers.held_arguments``) in a different state.

``python -m tests.programs.held_workers CASE [module]`` prints one JSON object: what each worker saw
(its pid, its parent, whether its dataset and ``collate_fn`` hold one tokenizer object, the token
ids it encoded, the value it read of a setting the trainer changed), the expected ids, the
forkserver's pid and the holding servers' (with their threads and whether they still run), and how
often each start pickled the dataset.

Cases: ``held`` (two epochs), ``changed`` (the dataset changed after the loader was made),
``server_killed`` (the server SIGKILLed once it has unpickled), ``unplain_init`` (a
``worker_init_fn`` that is an object), ``slow`` (the server takes 1.5 s to unpickle them),
``server_dies`` (the server exits as it unpickles them, the workers' requests in its queue),
``refused`` (two epochs; the server cannot unpickle them and says so). The dataset's tokenizer is
built in the trainer but for ``tokenizer`` (loaded by transformers' ``from_pretrained``, so held ahead
by a server of its own, as is the module of an image processor the dataset holds:
``workers.loaded_ahead``), ``tokenizer_changed`` (loaded, then a token added) and
``tokenizer_killed`` (loaded, every server of what was loaded SIGKILLed once it has done its part),
``tokenizer_parent_killed`` (loaded, the newest server of what was loaded stopped, then SIGKILLed once
the loader's server was sent to it) and
``tokenizer_swift`` (loaded in a process where ms-swift is patched).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import signal
import sys
import time

import swift_safe_media
from swift_safe_media import process
from torch.utils.data import DataLoader, Dataset

from tests import tiny_models

TEXTS = ["a clip of 2 s", "héllo wörld", "<tool_call>", "0123456789 " * 3]
PICKLED: list = []


class Marker:
    """Unpickled slowly in a holding server (1.5 s), which then exits in the case ``server_dies``;
    in the case ``refused``, it cannot be unpickled there."""

    def __init__(self, case: str):
        self.case = case

    def __reduce__(self):
        PICKLED.append(self.case)  # in the trainer: how often the start pickles the dataset
        return rebuilt_marker, (self.case,)


def rebuilt_marker(case: str) -> Marker:
    import multiprocessing

    from swift_safe_media.workers import held_arguments

    in_server = multiprocessing.current_process().name == held_arguments.SERVER_NAME
    if case == "refused" and in_server:
        raise ValueError("not in a holding server (tests.programs.held_workers)")
    if case in ("slow", "server_dies") and in_server:
        time.sleep(1.5)
        if case == "server_dies":
            os._exit(3)
    return Marker(case)


class Encoding(Dataset):
    def __init__(self, tokenizer, case: str):
        self.tokenizer = tokenizer
        self.suffix = ""
        self.marker = Marker(case)

    def __len__(self):
        return len(TEXTS)

    def __getitem__(self, index):
        return {"index": index, "ids": self.tokenizer.encode(TEXTS[index] + self.suffix).ids}


class Collate:
    """A collate_fn holding the dataset's own tokenizer (as a host's collator does)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.tokenizer = dataset.tokenizer

    def __call__(self, item):
        from torch.utils.data import get_worker_info

        from swift_safe_media.workers import held_arguments

        held = [key for key, unit in held_arguments._HELD.items() if len(unit) == 1 and unit[0] is self.tokenizer]
        imported = [name for unit in held_arguments._HELD.values() if len(unit) == 1 and type(unit[0]) is tuple
                    for name in unit[0]]
        return {**item, "pid": os.getpid(), "ppid": os.getppid(), "shared": self.tokenizer is get_worker_info().dataset.tokenizer,
                "same_dataset": self.dataset is get_worker_info().dataset, "setting": os.environ.get("HELD_TEST_SETTING"),
                "tokenizer_held_as": held, "modules_imported_ahead": imported}


class InitObject:
    def __call__(self, worker_id):
        pass


def described(server) -> dict:
    pid = server.process.pid
    try:
        threads = len(os.listdir(f"/proc/{pid}/task"))
        with open(f"/proc/{pid}/stat") as stat:
            parent = int(stat.read().rpartition(")")[2].split()[1])
    except OSError:
        threads, parent = 0, None
    return {"pid": pid, "threads": threads, "alive": server.process.is_alive(), "why_not": server.why_not,
            "keeps_bytes": server.data is not None, "bytes": len(server.data or b""), "parent": parent, "key": server.key}


def servers() -> list[dict]:
    return [described(server) for server in process.current().holding_servers]


def loaded(case: str):
    """A fast tokenizer saved, then loaded by ``from_pretrained`` (held ahead): its Rust tokenizer;
    and an image processor loaded by ``from_pretrained`` from its config (its module imported then)."""
    import tempfile
    from pathlib import Path

    from transformers import AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerFast

    folder = tempfile.mkdtemp(prefix="held-tokenizer-")
    atexit.register(shutil.rmtree, folder, True)  # the trainer's exit (its forks never run its atexit hooks)
    PreTrainedTokenizerFast(tokenizer_object=tiny_models._byte_level_tokenizer(), eos_token="<|im_end|>").save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if case == "tokenizer_changed":
        tokenizer.add_tokens(["zqxj"])  # its Rust tokenizer's state is not the one handed ahead now
    assert IMAGE_MODULE not in sys.modules
    Path(folder, "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    image_processor = AutoImageProcessor.from_pretrained(folder)
    if case == "tokenizer_parent_killed":  # the newest waits, stopped, as the loader's server is sent to it
        newest = process.current().loaded_ahead[-1]
        assert newest._ready.poll(60) and newest.may_serve()
        os.kill(newest.process.pid, signal.SIGSTOP)
    if case == "tokenizer_killed":
        for server in process.current().loaded_ahead:  # each has done its part, then all are killed
            assert server._ready.poll(60) and server.may_serve()
        for server in process.current().loaded_ahead:
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.join(10)
    return tokenizer._tokenizer, image_processor


IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"  # imported by the load


def recording_launches() -> list:
    """[(sent to a holding server, bytes written)] for each launch from now on."""
    from swift_safe_media.workers import forkserver_launch, held_arguments

    launches, stock_send = [], forkserver_launch._Popen._send

    def send(popen, data, connect_to_new_process):
        to_server = isinstance(getattr(connect_to_new_process, "__self__", None), held_arguments.HoldingServer)
        launches.append((to_server, len(data.getbuffer())))
        return stock_send(popen, data, connect_to_new_process)

    forkserver_launch._Popen._send = send
    return launches


def main(case: str) -> dict:
    from multiprocessing import forkserver

    hosts = ["swift"] if case == "tokenizer_swift" else []
    swift_safe_media.enable(hosts=hosts)
    if hosts:  # ms-swift patched in this process: its loaders name their own context
        importlib.import_module("swift.dataset.utils")
    process.current().shared_zygote.ready.wait(120)
    backend, image_processor = loaded(case) if case.startswith("tokenizer") else (tiny_models._byte_level_tokenizer(), None)
    dataset = Encoding(backend, case)
    dataset.image_processor = image_processor
    init = InitObject() if case == "unplain_init" else None
    loader = DataLoader(dataset, batch_size=None, num_workers=2, collate_fn=Collate(dataset), worker_init_fn=init)
    if case == "tokenizer_parent_killed":  # killed with the loader's server's launch in its queue, its pid unread
        newest = process.current().loaded_ahead[-1]
        os.kill(newest.process.pid, signal.SIGKILL)
        newest.process.join(10)
        server = process.current().holding_servers[0]
        server.may_serve()  # as the loader's start asks first: sent on to the warm forkserver
        assert server._ready.poll(120)
        made = []
    else:
        made = servers()
    os.environ["HELD_TEST_SETTING"] = "set after the loader was made"  # workers see the trainer's environment
    if case == "changed":
        dataset.suffix = " changed"
    if case == "server_killed":
        server = process.current().holding_servers[0]
        assert server._ready.poll(60) and server.may_serve()
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.join(10)
    if case == "refused":  # its answer is in before the start asks (one that comes later: ``server_dies``)
        assert process.current().holding_servers[0]._ready.poll(60)
    epochs, started, pickled, launches = [], [], [], recording_launches()
    exit_codes = []
    for _ in range(2 if case in ("held", "refused") else 1):
        began, pickled_before = time.monotonic(), len(PICKLED)
        iterator = iter(loader)
        started.append(time.monotonic() - began)  # the workers' start: queued in a server still unpickling
        pickled.append(len(PICKLED) - pickled_before)
        epochs.append(list(iterator))
        exit_codes.append([worker.exitcode for worker in iterator._workers])  # as torch's join at the end left them
    time.sleep(0.2)  # an ended server's exit
    held = process.current().held_tokenizer
    suffix = " changed" if case == "changed" else ""
    return {"epochs": epochs, "expected": [dataset.tokenizer.encode(text + suffix).ids for text in TEXTS],
            "forkserver": forkserver._forkserver._forkserver_pid, "servers_made": made, "servers": servers(), "started_s": started,
            "pickled_at_start": pickled, "tokenizer_key": held and held.server.key,
            "loaded_ahead": [described(server) for server in process.current().loaded_ahead], "launches": launches,
            "exit_codes": exit_codes}


if __name__ == "__main__":
    # ``CASE module``: the classes are this module's, not ``__main__``'s (which a pickle names).
    defined = importlib.import_module("tests.programs.held_workers") if sys.argv[2:] == ["module"] else sys.modules[__name__]
    print(json.dumps(defined.main(sys.argv[1])))
