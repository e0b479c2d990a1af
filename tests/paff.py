"""Field-coded interlaced H.264 (PAFF), written bit by bit: no encoder here makes it (x264
codes interlace per macroblock pair), and broadcast 1080i does. Every frame is two field
pictures, each an I slice of I_PCM macroblocks (raw samples, no prediction), so the
stream decodes to known pixels. In MPEG-TS each field is a packet: a packet count sees
twice the frames (torchcodec's exact scan), the decoder pairs the fields into frames.
"""

class Bits:
    """An H.264 RBSP written bit by bit: u(n), ue(v), se(v) as the standard names them."""

    def __init__(self):
        self.b = []
    def u(self, n, v):
        for i in reversed(range(n)): self.b.append((v >> i) & 1)
    def ue(self, v):
        v += 1; n = v.bit_length(); self.u(n - 1, 0); self.u(n, v)
    def se(self, v): self.ue(2 * v - 1 if v > 0 else -2 * v)
    def align(self):
        while len(self.b) % 8: self.b.append(0)
    def trailing(self): self.b.append(1); self.align()
    def raw(self, data):
        assert len(self.b) % 8 == 0
        for byte in data: self.u(8, byte)
    def bytes(self):
        return bytes(int("".join(map(str, self.b[i:i + 8])), 2) for i in range(0, len(self.b), 8))

def nal(ref_idc, kind, payload):
    """An Annex B NAL unit, with the emulation prevention bytes the payload needs."""
    out, zeros = bytearray(), 0
    for byte in payload:
        if zeros >= 2 and byte <= 3:
            out.append(3); zeros = 0
        out.append(byte); zeros = zeros + 1 if byte == 0 else 0
    return b"\x00\x00\x00\x01" + bytes([(ref_idc << 5) | kind]) + bytes(out)

def paff(width=64, height=64, frames=31) -> bytes:
    """Main profile, frame_mbs_only_flag 0, 29.97 frames (59.94 fields) a second per the
    VUI; the first top field is the IDR picture, every other field a non-IDR I field."""
    sps = Bits(); sps.u(8, 77); sps.u(8, 0); sps.u(8, 30); sps.ue(0); sps.ue(0); sps.ue(0); sps.ue(4); sps.ue(1)
    sps.u(1, 0); sps.ue(width // 16 - 1); sps.ue(height // 32 - 1); sps.u(1, 0); sps.u(1, 0); sps.u(1, 1); sps.u(1, 0)
    sps.u(1, 1); sps.u(1, 0); sps.u(1, 0); sps.u(1, 0); sps.u(1, 0); sps.u(1, 1); sps.u(32, 1001); sps.u(32, 60000)
    sps.u(1, 1); sps.u(1, 0); sps.u(1, 0); sps.u(1, 0); sps.u(1, 0); sps.trailing()
    pps = Bits(); pps.ue(0); pps.ue(0); pps.u(1, 0); pps.u(1, 0); pps.ue(0); pps.ue(0); pps.ue(0); pps.u(1, 0)
    pps.u(2, 0); pps.se(0); pps.se(0); pps.se(0); pps.u(1, 1); pps.u(1, 0); pps.u(1, 0); pps.trailing()
    out = [nal(3, 7, sps.bytes()), nal(3, 8, pps.bytes())]
    for k in range(frames):
        for bottom in (0, 1):
            idr = k == 0 and bottom == 0
            s = Bits(); s.ue(0); s.ue(7); s.ue(0); s.u(4, k % 16); s.u(1, 1); s.u(1, bottom)
            if idr: s.ue(0)
            s.u(8, (4 * k + bottom) % 256)
            s.u(1, 0)
            if idr: s.u(1, 0)
            s.se(0); s.ue(1)
            for mby in range(height // 32):
                for mbx in range(width // 16):
                    s.ue(25); s.align()
                    luma = bytes(16 + ((mbx * 16 + x + 2 * (mby * 16 + y) + bottom + 8 * k) % 200)
                                 for y in range(16) for x in range(16))
                    s.raw(luma + bytes([128]) * 64 + bytes([96 + 4 * (k % 16)]) * 64)
            s.trailing()
            out.append(nal(3, 5 if idr else 1, s.bytes()))
    return b"".join(out)
