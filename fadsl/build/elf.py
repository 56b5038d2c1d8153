"""Read an initialised global out of a cubin (an ELF64 file) without a GPU.

The sm_90a kernels export ``int <kernel>_launch_info[5]`` (threads, dynamic SMEM bytes,
B_r, B_c, CTAs per cluster). Reading it from the cubin's bytes needs no context and no
device copy, so it is safe inside a CUDA graph capture, and the host can check its plan
against what the compiler built before the first launch.
"""

from __future__ import annotations

import struct

_SHT_SYMTAB, _SHT_NOBITS = 2, 8


class ElfError(ValueError):
    """The cubin is not the ELF64 file expected, or lacks the symbol."""


def read_symbol(image: bytes, name: str) -> bytes:
    """The initial bytes of the global ``name`` in the ELF64 little-endian ``image``."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", image, shoff + i * shentsize) for i in range(shnum)
    ]
    for sh in sections:
        if sh[1] != _SHT_SYMTAB:
            continue
        strtab = sections[sh[6]]
        for offset in range(sh[4], sh[4] + sh[5], sh[9]):
            st_name, _info, _other, shndx, value, size = struct.unpack_from(
                "<IBBHQQ", image, offset
            )
            start = strtab[4] + st_name
            if image[start : image.index(b"\0", start)].decode() != name:
                continue
            section = sections[shndx] if 0 < shndx < shnum else None
            if section is None or section[1] == _SHT_NOBITS:
                raise ElfError(f"{name} has no initial value in the cubin")
            begin = section[4] + value
            return bytes(image[begin : begin + size])
    raise ElfError(f"the cubin has no symbol {name}")


def read_ints(image: bytes, name: str, count: int) -> tuple[int, ...]:
    data = read_symbol(image, name)
    if len(data) != 4 * count:
        raise ElfError(f"{name} has {len(data)} bytes, expected {4 * count}")
    return struct.unpack(f"<{count}i", data)
