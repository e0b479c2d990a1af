"""Is the file whole? Partial files caught from their index alone, before decoding.

An interrupted download or copy leaves a file whose index still promises every frame
while the data holds only the first ones. Decoders then return the frames that exist,
with no error (stock decord raises; torchcodec returns what it finds), and a model
trains on a clip whose label describes the whole. Here the index is compared with the
file's size, reading only the index (an MP4's ``moov``/``moof`` boxes, a WAV's chunk
headers), never the payload:

- MP4/MOV: every sample of a video or audio track must end inside the file. Sample
  positions come from ``stco``/``co64`` + ``stsc`` + ``stsz``/``stz2`` (an ordinary
  file, ``moov`` before or after ``mdat``) or from ``moof``/``traf``/``trun``
  (a fragmented one). An edit list that hides pre-roll frames does not matter: those
  frames are in the file, only not shown.
- WAV (RIFF, RIFX, RF64): the ``data`` chunk must end inside the file. The sizes
  written by a streaming writer that could not seek back (0xFFFFFFFF, or 0) promise
  nothing and are not checked: the decoder reads what is there, and an empty result is
  an error anyway.

Formats without an index to compare (Matroska/WebM, Ogg, MP3, ADTS, ...) are left to
the decoder. An index that cannot be parsed is left to the decoder too: this check only
ever refuses a file whose own index says it is incomplete.
"""

from __future__ import annotations

import os
import struct

from ..errors import MediaDecodeError

# An index larger than this is not read here (the decoder still judges the file): a
# sample table this size describes hours of media, and the check must stay cheap.
MAX_INDEX_BYTES = 128 << 20
# Top-level boxes walked before giving up (fragmented files have two per fragment).
MAX_TOP_LEVEL_BOXES = 1 << 20

_MP4_CONTAINERS = {b"trak", b"mdia", b"minf", b"stbl", b"mvex", b"traf", b"edts"}
_TRACK_KINDS = {b"vide": "video", b"soun": "audio"}
# WAV data sizes that streaming writers leave when they cannot seek back to fix them.
_UNKNOWN_WAV_SIZES = (0, 0xFFFFFFFF)


class Reader:
    """Positional reads from a file descriptor or from bytes, and the size."""

    def __init__(self, data: bytes | None = None, fd: int | None = None, size: int = 0):
        self.data, self.fd, self.size = data, fd, size if data is None else len(data)

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length <= 0 or offset >= self.size:
            return b""
        if self.data is not None:
            return self.data[offset:offset + length]
        return os.pread(self.fd, length, offset)


def truncated(label, kind: str, what: str, promised: int, held: int) -> MediaDecodeError:
    return MediaDecodeError(label, f"truncated: index promises {promised} {what}, file holds {held} ({kind})")


def check_complete(label, container: str, reader: Reader) -> None:
    """Raise MediaDecodeError("truncated: ...") if `reader`'s index promises data past its end."""
    try:
        if container == "mp4/mov":
            _check_mp4(label, reader)
        elif container == "wav":
            _check_wav(label, reader)
    except (struct.error, ValueError, IndexError, OverflowError):
        return  # an index this check cannot parse: the decoder judges the file


# --- MP4 / MOV ---------------------------------------------------------------------------

def _boxes(data: bytes, start: int = 0, end: int | None = None):
    """(type, payload start, payload end) of the boxes in data[start:end]; stops at a
    box that overruns its parent (the caller then has only part of the index)."""
    end = len(data) if end is None else end
    offset = start
    while offset + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, offset)
        header = 8
        if size == 1:
            if offset + 16 > end:
                return
            (size,) = struct.unpack_from(">Q", data, offset + 8)
            header = 16
        elif size == 0:
            size = end - offset
        if size < header or offset + size > end:
            return
        yield kind, offset + header, offset + size
        offset += size


def _find(data: bytes, start: int, end: int, *path: bytes):
    """(start, end) of the first box along `path` under data[start:end], or None."""
    for name in path:
        for kind, child_start, child_end in _boxes(data, start, end):
            if kind == name:
                start, end = child_start, child_end
                break
        else:
            return None
    return start, end


def _top_level(reader: Reader):
    """(type, box start, header size, declared end) of each top-level box, in file order."""
    offset = 0
    for _ in range(MAX_TOP_LEVEL_BOXES):
        head = reader.read(offset, 16)
        if len(head) < 8:
            return
        size, kind = struct.unpack_from(">I4s", head)
        header = 8
        if size == 1:
            if len(head) < 16:
                return
            (size,) = struct.unpack_from(">Q", head, 8)
            header = 16
        elif size == 0:
            size = reader.size - offset
        if size < header:
            return  # malformed: the decoder will say so
        yield kind, offset, header, offset + size
        offset += size


def _check_mp4(label, reader: Reader) -> None:
    moov = None
    fragments: list[tuple[int, int, int]] = []  # (moof start, header size, declared end)
    cut_fragment = None
    for kind, start, header, end in _top_level(reader):
        if kind == b"moov":
            if end > reader.size:
                raise MediaDecodeError(label, f"truncated: the index (moov box, {end - start} bytes) "
                                              f"ends past the end of the file ({reader.size} bytes) (mp4/mov)")
            if end - start <= MAX_INDEX_BYTES:
                moov = reader.read(start + header, end - start - header)
        elif kind == b"moof":
            if end > reader.size:
                cut_fragment = start
                break
            if end - start <= MAX_INDEX_BYTES:
                fragments.append((start, header, end))
        if end >= reader.size:
            break
    if moov is None:
        return  # no index here (moov cut off, or never written): the decoder says what it can
    tracks = _tracks(moov)
    for track in tracks.values():
        if track.kind is None:
            continue
        promised, held = _sample_table_counts(moov, track, reader.size)
        if promised is not None and held < promised:
            raise truncated(label, "mp4/mov", f"{track.kind} frames" if track.kind == "audio" else "frames",
                            promised, held)
    if fragments or cut_fragment is not None:
        _check_fragments(label, reader, tracks, fragments, cut_fragment)


class _Track:
    def __init__(self):
        self.id, self.kind, self.stbl, self.default_size = 0, None, None, 0


def _tracks(moov: bytes) -> dict[int, _Track]:
    tracks: dict[int, _Track] = {}
    trex_sizes = {}
    mvex = _find(moov, 0, len(moov), b"mvex")
    if mvex is not None:
        for kind, start, end in _boxes(moov, *mvex):
            if kind == b"trex" and end - start >= 24:
                track_id, _, _, default_size = struct.unpack_from(">IIII", moov, start + 4)
                trex_sizes[track_id] = default_size
    for kind, start, end in _boxes(moov, 0, len(moov)):
        if kind != b"trak":
            continue
        track = _Track()
        tkhd = _find(moov, start, end, b"tkhd")
        if tkhd is not None and tkhd[1] - tkhd[0] >= 24:
            offset = tkhd[0] + (20 if moov[tkhd[0]] == 1 else 12)
            (track.id,) = struct.unpack_from(">I", moov, offset)
        hdlr = _find(moov, start, end, b"mdia", b"hdlr")
        if hdlr is not None and hdlr[1] - hdlr[0] >= 12:
            track.kind = _TRACK_KINDS.get(moov[hdlr[0] + 8:hdlr[0] + 12])
        track.stbl = _find(moov, start, end, b"mdia", b"minf", b"stbl")
        track.default_size = trex_sizes.get(track.id, 0)
        tracks[track.id] = track
    return tracks


def _full_box(data: bytes, box) -> tuple[int, int]:
    """(flags, payload start after version and flags) of a full box."""
    (word,) = struct.unpack_from(">I", data, box[0])
    return word & 0xFFFFFF, box[0] + 4


def _sample_table_counts(moov: bytes, track: _Track, file_size: int):
    """(samples the table lists, samples that end inside the file), or (None, 0)."""
    import numpy as np

    if track.stbl is None:
        return None, 0
    tables = {kind: (start, end) for kind, start, end in _boxes(moov, *track.stbl)}
    sizes = _sample_sizes(moov, tables)
    chunk_box = tables.get(b"stco") or tables.get(b"co64")
    stsc = tables.get(b"stsc")
    if sizes is None or chunk_box is None or stsc is None or len(sizes) == 0:
        return None, 0
    wide = b"co64" in tables and b"stco" not in tables
    _, at = _full_box(moov, chunk_box)
    (chunks,) = struct.unpack_from(">I", moov, at)
    if at + 4 + chunks * (8 if wide else 4) > chunk_box[1]:
        return None, 0
    offsets = np.frombuffer(moov, ">u8" if wide else ">u4", chunks, at + 4).astype(np.int64)
    _, at = _full_box(moov, stsc)
    (entries,) = struct.unpack_from(">I", moov, at)
    if entries == 0 or at + 4 + entries * 12 > stsc[1]:
        return None, 0
    table = np.frombuffer(moov, ">u4", entries * 3, at + 4).astype(np.int64).reshape(entries, 3)
    first_chunks, per_chunk = table[:, 0], table[:, 1]
    if first_chunks[0] != 1 or np.any(np.diff(first_chunks) <= 0) or np.any(per_chunk <= 0):
        return None, 0
    runs = np.diff(np.append(first_chunks, chunks + 1))
    if np.any(runs < 0):
        return None, 0
    samples_per_chunk = np.repeat(per_chunk, runs)[:chunks]
    listed = min(len(sizes), int(samples_per_chunk.sum()))
    if listed == 0:
        return None, 0
    chunk_of_sample = np.repeat(np.arange(chunks), samples_per_chunk)[:listed]
    first_sample_of_chunk = np.cumsum(samples_per_chunk) - samples_per_chunk
    total = np.concatenate(([0], np.cumsum(sizes[:listed], dtype=np.int64)))
    within = total[1:] - total[first_sample_of_chunk[chunk_of_sample]]
    ends = offsets[chunk_of_sample] + within
    return len(sizes), int(np.count_nonzero(ends <= file_size))


def _sample_sizes(moov: bytes, tables):
    import numpy as np

    if b"stsz" in tables:
        box = tables[b"stsz"]
        _, at = _full_box(moov, box)
        constant, count = struct.unpack_from(">II", moov, at)
        if constant:
            return np.full(count, constant, dtype=np.int64)
        if at + 8 + count * 4 > box[1]:
            return None
        return np.frombuffer(moov, ">u4", count, at + 8).astype(np.int64)
    if b"stz2" in tables:
        box = tables[b"stz2"]
        _, at = _full_box(moov, box)
        field_bits, count = moov[at + 3], struct.unpack_from(">I", moov, at + 4)[0]
        start = at + 8
        if field_bits == 4:
            if start + (count + 1) // 2 > box[1]:
                return None
            packed = np.frombuffer(moov, np.uint8, (count + 1) // 2, start)
            return np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)[:count].astype(np.int64)
        if field_bits in (8, 16):
            width = field_bits // 8
            if start + count * width > box[1]:
                return None
            return np.frombuffer(moov, ">u1" if width == 1 else ">u2", count, start).astype(np.int64)
    return None


def _check_fragments(label, reader: Reader, tracks, fragments, cut_fragment) -> None:
    """Samples listed by each moof's trun boxes must end inside the file."""
    counted = {}  # track id -> [promised, held]
    for moof_start, header, moof_end in fragments:
        moof = reader.read(moof_start, moof_end - moof_start)
        next_base = moof_start  # a traf without an explicit base follows the previous one
        for kind, start, end in _boxes(moof, header, len(moof)):
            if kind != b"traf":
                continue
            found = _fragment_samples(moof, start, end, moof_start, next_base, tracks)
            if found is None:
                return  # a layout this check does not follow: leave it to the decoder
            track_id, listed, held, next_base = found
            totals = counted.setdefault(track_id, [0, 0])
            totals[0] += listed
            totals[1] += sum(1 for sample_end in held if sample_end <= reader.size)
    for track_id, (promised, held) in counted.items():
        track = tracks.get(track_id)
        if track is not None and track.kind is not None and held < promised:
            raise truncated(label, "fragmented mp4", f"{track.kind} frames" if track.kind == "audio" else "frames",
                            promised, held)
    if cut_fragment is not None:
        raise MediaDecodeError(label, f"truncated: the fragment index (moof box at byte {cut_fragment}) ends past "
                                      f"the end of the file ({reader.size} bytes) (fragmented mp4)")


def _fragment_samples(moof: bytes, start: int, end: int, moof_start: int, next_base: int, tracks):
    """(track id, samples listed, their end offsets, end of this traf's data) or None."""
    tfhd = _find(moof, start, end, b"tfhd")
    if tfhd is None or tfhd[1] - tfhd[0] < 8:
        return None
    flags, at = _full_box(moof, tfhd)
    (track_id,) = struct.unpack_from(">I", moof, at)
    at += 4
    base = next_base
    if flags & 0x1:
        (base,) = struct.unpack_from(">Q", moof, at)
        at += 8
    elif flags & 0x20000:  # default-base-is-moof
        base = moof_start
    at += 4 if flags & 0x2 else 0
    at += 4 if flags & 0x8 else 0
    track = tracks.get(track_id)
    default_size = track.default_size if track is not None else 0
    if flags & 0x10:
        (default_size,) = struct.unpack_from(">I", moof, at)
    ends, listed, position = [], 0, base
    for kind, run_start, run_end in _boxes(moof, start, end):
        if kind != b"trun":
            continue
        run_flags, at = _full_box(moof, (run_start, run_end))
        (count,) = struct.unpack_from(">I", moof, at)
        at += 4
        if run_flags & 0x1:
            (data_offset,) = struct.unpack_from(">i", moof, at)
            position = base + data_offset
            at += 4
        at += 4 if run_flags & 0x4 else 0
        fields = [bit for bit in (0x100, 0x200, 0x400, 0x800) if run_flags & bit]
        if at + count * 4 * len(fields) > run_end:
            return None
        size_field = fields.index(0x200) if 0x200 in fields else None
        for index in range(count):
            size = default_size
            if size_field is not None:
                (size,) = struct.unpack_from(">I", moof, at + (index * len(fields) + size_field) * 4)
            position += size
            ends.append(position)
        listed += count
    return track_id, listed, ends, position


# --- WAV ---------------------------------------------------------------------------------

def _check_wav(label, reader: Reader) -> None:
    head = reader.read(0, 12)
    big_endian = head.startswith(b"RIFX")
    order = ">" if big_endian else "<"
    rf64_data_size = None
    block_align = 0
    offset = 12
    for _ in range(4096):  # a WAV has a handful of chunks before its data
        chunk = reader.read(offset, 8)
        if len(chunk) < 8:
            return
        name, size = chunk[:4], struct.unpack(order + "I", chunk[4:])[0]
        start = offset + 8
        if name == b"ds64":
            body = reader.read(start, 16)
            if len(body) == 16:
                rf64_data_size = struct.unpack("<Q", body[8:16])[0]
        elif name == b"fmt ":
            body = reader.read(start, 16)
            if len(body) >= 14:
                (block_align,) = struct.unpack(order + "H", body[12:14])
        elif name == b"data":
            if head.startswith(b"RF64") and size == 0xFFFFFFFF and rf64_data_size is not None:
                size = rf64_data_size
            elif size in _UNKNOWN_WAV_SIZES:
                return
            if start + size > reader.size:
                unit = block_align if block_align > 0 else 1
                what = "frames" if block_align > 0 else "bytes of audio"
                raise truncated(label, "wav", what, size // unit, max(reader.size - start, 0) // unit)
            return
        offset = start + size + (size & 1)
