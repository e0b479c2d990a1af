# A user's own training script (issue 43), run every way Python runs one by
# tests/test_run_modes.py: as a file (with and without the main guard), with -m, -c, on
# stdin, exec'd as a notebook cell, in a Jupyter kernel; every line stands alone (-c, a
# cell). PROTECT=1 calls enable(); CLIPS names a folder of WAV files, each decoded by
# soundfile.read in one of a DataLoader's 2 workers. It prints "MAIN pid" once per run of
# main(), the samples' checksum (stock's, with or without PROTECT), then whether the reads
# were bounded and whether the workers were forked from this process (as stock's are).
import os, zlib
import soundfile
import swift_safe_media
from torch.utils.data import DataLoader, Dataset


class Clips(Dataset):
    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        samples, rate = soundfile.read(self.paths[index], dtype="int16")
        # soundfile.read under enable() is the bounded stand-in, which wraps stock's
        return zlib.crc32(samples.tobytes()) + rate, hasattr(soundfile.read, "__wrapped__"), os.getpid(), os.getppid()


def main():
    print("MAIN", os.getpid(), flush=True)
    if os.environ.get("PROTECT") == "1":
        swift_safe_media.enable(timeout=20)
    folder = os.environ["CLIPS"]
    paths = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".wav"))
    sums, bounded, workers, parents = [], set(), set(), set()
    for crcs, flags, pids, ppids in DataLoader(Clips(paths), batch_size=2, num_workers=2):
        sums += crcs.tolist()
        bounded.update(flags.tolist())
        workers.update(pids.tolist())
        parents.update(ppids.tolist())
    print("CHECKSUM", len(sums), zlib.crc32(repr(sums).encode()), flush=True)
    print("BOUNDED", sorted(bounded), "WORKERS", len(workers), "FORKED", parents == {os.getpid()}, flush=True)


if __name__ == "__main__":
    main()
