"""The check the Ray scan tests run in each sandbox: the scan's own decode, except for
items planted to fail natively (module level, so Ray and the sandbox import it by name)."""

import ctypes

from swift_safe_media.checks import scan

SPIN = b"plant:spin:"  # followed by the path of a library whose spin_forever() never returns
SEGV = b"plant:segv"


def decode_or_fail_natively(item) -> None:
    with open(item.path, "rb") as media:
        head = media.read(512)
    if head.startswith(SPIN):
        ctypes.PyDLL(head[len(SPIN):].decode().strip()).spin_forever()  # holds the GIL for ever
    if head.startswith(SEGV):
        ctypes.string_at(0)  # a real segmentation fault
    scan.decode_and_discard(item)
