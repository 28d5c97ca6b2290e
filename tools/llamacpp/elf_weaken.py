"""Mark the GLIBC_2.38 version need weak in an ELF64 shared object, in place (see install.sh).

Usage: python elf_weaken.py LIB.so   (prints ``LIB.so weakened N``)

A weak version need lets the dynamic loader accept a glibc older than 2.38; the four C23 symbols
that need asks for are then defined by the shim install.sh builds (c23shim.c).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

__all__ = ["weaken"]

SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2


def weaken(data: bytearray, version: bytes = b"GLIBC_2.38") -> int:
    """Set the weak flag on every need of ``version`` in an ELF64 little-endian image.

    Returns:
        how many version needs were marked.
    """
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, _ = struct.unpack_from("<HHH", data, 0x3A)
    sections = []
    for i in range(shnum):
        fields = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        _, kind, _, _, offset, _, link, info, _, _ = fields
        sections.append((kind, offset, link, info))
    marked = 0
    for kind, offset, link, info in sections:
        if kind != SHT_GNU_VERNEED:
            continue
        strings = sections[link][1]
        need = offset
        for _ in range(info):
            _, count, _, aux, following = struct.unpack_from("<HHIII", data, need)
            at = need + aux
            for _ in range(count):
                _, flags, _, name, next_aux = struct.unpack_from("<IHHII", data, at)
                start = strings + name
                if bytes(data[start : data.index(0, start)]) == version:
                    struct.pack_into("<H", data, at + 4, flags | VER_FLG_WEAK)
                    marked += 1
                at += next_aux
            need += following
    return marked


def main(path: str) -> None:
    """Weaken ``path`` in place and say how many needs were marked."""
    file = Path(path)
    data = bytearray(file.read_bytes())
    marked = weaken(data)
    file.write_bytes(bytes(data))
    print(path, "weakened", marked)


if __name__ == "__main__":
    main(sys.argv[1])
