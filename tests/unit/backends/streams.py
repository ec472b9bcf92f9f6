"""Feeding a stream translator the way the network does: in arbitrary pieces."""

from __future__ import annotations

from backends.base import StreamTranslator


def fed(translator: StreamTranslator, data: bytes, cuts: list[int]) -> bytes:
    """What `translator` sends for `data` arriving in pieces split at the offsets `cuts` (ascending),
    its `close()` included."""
    out = bytearray()
    start = 0
    for cut in [*cuts, len(data)]:
        out += translator.feed(data[start:cut])
        start = cut
    return bytes(out + translator.close())
