"""What an input's first bytes start: a media container or elementary stream that one of
FFmpeg's allow-listed demuxers reads (``demuxers.ALLOWED``), or None.

Only a first filter: FFmpeg's own probe must then pick a demuxer allowed for the kind
named here (``demuxers.check``), so a loose signature (an elementary stream's start code)
lets nothing through that FFmpeg would read otherwise.
"""

from __future__ import annotations

# Bytes read from the start of an input to name what it holds. Enough for four
# MPEG-TS packets of the longest size (204 bytes, with Reed-Solomon parity).
HEAD_BYTES = 1024

# MPEG-TS packet layouts: (offset of the first sync byte, packet size). 188 is plain
# TS; 192 is M2TS (Blu-ray, AVCHD camcorders: a 4-byte timestamp before each packet);
# 204 carries 16 bytes of parity after each packet (DVB captures).
_TS_LAYOUTS = ((0, 188), (4, 192), (0, 204))
_TS_PACKETS_CHECKED = 4

# How far into an input MPEG audio or ADTS frames are looked for behind junk (a broken
# tag, a stray header): as far as FFmpeg's probe looks (``demuxers.PROBE_MAX``), and
# how many frames must follow each other there for the sync to count.
SCAN_BYTES = 1 << 20
_FRAMES_CHAINED = 4

# Headerless formats FFmpeg itself chooses by the file name only (its demuxer has no
# probe): extension -> kind. Only where no bytes say anything (``guards.check_head``).
RAW_BY_EXTENSION = {".g722": "g722", ".722": "g722",
                    ".gsm": "gsm"}  # raw GSM 6.10 frames: telephony prompts and recordings (Asterisk's)

_MAGIC = (
    (b"\x1a\x45\xdf\xa3", "matroska/webm"),
    (b"fLaC", "flac"),
    (b"OggS", "ogg"),
    (b"ID3", "mp3/aac"),  # a tag before MPEG audio or ADTS frames
    (b"caff", "caf"),
    (b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", "asf/wmv"),
    (b"FLV\x01", "flv"),
    (b"#!AMR", "amr/au/wavpack/ape"),  # AMR-NB and AMR-WB ("#!AMR-WB")
    (b".snd", "amr/au/wavpack/ape"),
    (b"wvpk", "amr/au/wavpack/ape"),
    (b"MAC ", "amr/au/wavpack/ape"),
    # Sony Wave64: "riff" and the rest of its GUID.
    (b"riff\x2e\x91\xcf\x11\xa5\xd6\x28\xdb\x04\xc1\x00\x00", "w64"),
    (b"DKIF", "ivf"),  # VP8 / VP9 / AV1 in IVF, what libvpx and libaom write
    (b"YUV4MPEG2 ", "y4m"),
    (b"nut/multimedia container\x00", "nut"),
    (b"Creative Voice File\x1a", "voc"),
    (b"MPCK", "musepack"),  # Musepack SV8
    (b"MP+", "musepack"),  # Musepack SV7
    (b"GIF87a", "gif"),  # animated GIFs, as scraped video corpora hold them
    (b"GIF89a", "gif"),
    (b"NIST_1A\n", "nistsphere"),  # NIST SPHERE: TIMIT, Switchboard, other LDC speech corpora
    (b"TTA1", "tta"),  # True Audio
    (b"tBaK", "tak"),  # Tom's lossless Audio Kompressor
    (b"DSD \x1c\x00\x00\x00\x00\x00\x00\x00", "dsf"),  # Sony DSD stream file: its 28-byte DSD chunk
    (b"FWS", "swf"),  # Flash: MP3 or FLV1 in SWF tags (torchcodec's own test assets have one)
    (b"CWS", "swf"),  # the same, zlib-compressed; FFmpeg's demuxer reads both
)


def is_mp3_frame(head: bytes) -> bool:
    """An MPEG audio frame header: 11 sync bits, a version other than the reserved 01, a
    layer (00 is reserved: that is ADTS), a bitrate index other than 1111 and a sample
    rate index other than 11."""
    return (len(head) >= 4 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x18 != 0x08
            and head[1] & 0x06 != 0 and head[2] & 0xF0 != 0xF0 and head[2] & 0x0C != 0x0C)


# kbit/s by bitrate index, for (MPEG-1?, layer): layer 1 is 3, layer 3 is 1 in the header.
_MP3_KBPS = {
    (True, 3): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 1): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 3): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def mp3_frame_length(head: bytes) -> int:
    """Length of the MPEG audio frame these bytes start (from its bit rate, sample rate
    and padding), or 0 if they start none or a free-format one (no length to check)."""
    if not is_mp3_frame(head):
        return 0
    version, layer = (head[1] >> 3) & 3, (head[1] >> 1) & 3
    mpeg1 = version == 3
    kbps = _MP3_KBPS[(mpeg1, layer if mpeg1 or layer == 3 else 2)][head[2] >> 4]
    rate, padding = _MP3_RATES[version][(head[2] >> 2) & 3], (head[2] >> 1) & 1
    if kbps == 0:
        return 0
    if layer == 3:
        return (12 * kbps * 1000 // rate + padding) * 4
    return (144 if mpeg1 or layer == 2 else 72) * kbps * 1000 // rate + padding


def _chained_audio_frames(data: bytes) -> bool:
    """Whether an MPEG audio or ADTS frame starts somewhere in `data` and each of the next
    ``_FRAMES_CHAINED`` starts where the previous one ends (or the input ends)."""
    at = data.find(b"\xff")
    while at >= 0:
        for length_of in (mp3_frame_length, adts_frame_length):
            position, chained = at, 0
            while chained < _FRAMES_CHAINED:
                length = length_of(data[position:position + 7])
                if not length:
                    break
                position, chained = position + length, chained + 1
                if position >= len(data):
                    chained = _FRAMES_CHAINED
            if chained >= _FRAMES_CHAINED:
                return True
        at = data.find(b"\xff", at + 1)
    return False


def adts_frame_length(head: bytes) -> int:
    """Length of the ADTS AAC frame these bytes start (its header's own field), or 0 if
    they do not start one: 12 sync bits, layer 00, a sample rate index below 13 and a
    frame long enough for its header (7 bytes, 9 with a CRC)."""
    if len(head) < 7 or head[0] != 0xFF or head[1] & 0xF6 != 0xF0 or (head[2] >> 2) & 0x0F > 12:
        return 0
    length = (head[3] & 0x03) << 11 | head[4] << 3 | head[5] >> 5
    return length if length >= (7 if head[1] & 0x01 else 9) else 0


def _is_ac3(head: bytes) -> bool:
    """An AC-3 / E-AC-3 sync frame: sync word 0x0B77, then a bitstream id (bits 40-44)
    that AC-3 (<= 10) or E-AC-3 (11-16) uses."""
    return len(head) >= 6 and head[:2] == b"\x0b\x77" and head[5] >> 3 <= 16


def _start_code(head: bytes) -> int | None:
    """The code after an MPEG start code prefix (00 00 01) that these bytes start with,
    after the leading zero bytes an Annex B stream may have; None if they start none."""
    zeros = 0
    while zeros < min(len(head), 32) and head[zeros] == 0:
        zeros += 1
    if zeros >= 2 and zeros + 1 < len(head) and head[zeros] == 1:
        return head[zeros + 1]
    return None


def ts_layout(head: bytes) -> tuple[int, int] | None:
    """(first sync byte, packet size) of the MPEG-TS layout these bytes follow: the 0x47
    sync byte where each of the first packets starts (as many as `head` holds, up to
    four, at least two when it holds two)."""
    for offset, size in _TS_LAYOUTS:
        positions = [offset + k * size for k in range(_TS_PACKETS_CHECKED) if offset + k * size < len(head)]
        if positions and all(head[p] == 0x47 for p in positions) and \
                (len(positions) > 1 or len(head) <= offset + size):
            return offset, size
    return None


def container_of(head: bytes) -> str | None:
    """Name of the media container or elementary stream these first bytes start, or
    None if not an allowed one. `head`: the input's first bytes; ``HEAD_BYTES`` name most
    containers, up to ``SCAN_BYTES`` find MPEG audio or ADTS frames behind junk."""
    kind = _container_at_start(head[:HEAD_BYTES])
    if kind is None and len(head) > HEAD_BYTES and _chained_audio_frames(head[:SCAN_BYTES]):
        return "mp3/aac"  # FFmpeg's probe finds the sync; it must pick mp3 or aac (``demuxers``)
    return kind


def _container_at_start(head: bytes) -> str | None:
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot"):
        return "mp4/mov"
    if head.startswith((b"RIFF", b"RIFX", b"RF64")) and head[8:12] in (b"WAVE", b"AVI ", b"AVIX"):
        return "wav" if head[8:12] == b"WAVE" else "avi"
    if head.startswith(b"RIFF") and head[8:12] == b"QLCM":
        return "qcp"  # Qualcomm PureVoice (QCELP, EVRC): phone voice memos
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if is_mp3_frame(head):
        return "mp3"
    if adts_frame_length(head):
        return "aac"
    if head.startswith(b"FORM") and head[8:12] in (b"AIFF", b"AIFC"):
        return "aiff"
    if _is_ac3(head):
        return "ac3"
    if ts_layout(head):
        return "mpeg-ts"
    code = _start_code(head)
    if code == 0xBA:
        return "mpeg-ps"  # a program stream's pack header (DVD VOB, .mpg)
    if code is not None:
        # MPEG-1/2 video (sequence header 0xB3), MPEG-4 Part 2, H.264 or HEVC Annex B:
        # FFmpeg's probe tells them apart (the first byte after the prefix overlaps).
        return "video-es"
    return None
