"""A model of the FP8 forward's register and SMEM layouts (research/fp8-forward.md §3.3-§3.4).

Everything is modelled per thread as the PTX ISA states it, for one consumer warpgroup (64
query rows) and the producer warpgroup's 4 warps; "thread (g, t)" is lane 4g + t:

- the wgmma layouts: the 8-bit A fragment of m64nNk32 (CUTLASS's ``ALayout_64x32``: register
  r byte b of thread (g, t) of warp w holds A(16w + g + 8(r % 2), 16(r / 2) + 4t + b)) and the
  fp32 accumulator (``CLayout_64xN``: d[4j + 2r + e] = D(16w + g + 8r, 8j + 2t + e));
- ``convert_p8``: the accumulator's P packed into A registers, four e4m3 a register;
- the transpose of V by the producer warps: ``ldmatrix.x4.trans`` (b16) from the raw V tile,
  two ``prmt`` per pair of results, ``stmatrix.x4`` (b16) into Vt, whose rows are head_dim
  columns permuted by ``rho`` (8 consecutive rows per stmatrix matrix: no bank conflict);
- the swizzles (128-byte rows: ``Swizzle<3,4,3>``, 64-byte rows: ``Swizzle<2,4,3>``) and the
  panels (Vt: rows of 128 keys, or 64 when B_c is not a multiple of 128; raw V: rows of 128
  head_dim bytes, 64 at head_dim 64);
- the RS wgmma over K-major Vt, and ``unpermute_o``: the accumulator's columns come out in
  rho's order, and one swap of registers per 16 columns restores the usual layout.

Each choice the design makes is a parameter (``Choices``), so that the tests can remove it
and see the product go wrong (or, for rho, the stores conflict).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WARPS = 4  # a warpgroup's warps; the producer's 4 warps transpose
LANES = 32
BANK_BYTES = 128  # 32 banks of 4 bytes: a wavefront of shared memory


@dataclass(frozen=True)
class Choices:
    """The design's choices, each one a test can remove."""

    fp8_packing: bool = True  # convert_p8's quads (else the 16-bit kernel's consecutive order)
    prmt: bool = True  # the transpose's byte permutes (else x0..x3 stored as loaded)
    rho: bool = True  # Vt rows permuted so that a stmatrix matrix writes 8 consecutive rows
    unpermute: bool = True  # O's register swap after the last P V


DESIGN = Choices()


# --- wgmma register layouts ------------------------------------------------------------


def a_position(warp: int, g: int, t: int, reg: int, byte: int) -> tuple[int, int]:
    """(row, k) of the 8-bit A fragment's register ``reg`` byte ``byte``: ALayout_64x32."""
    return 16 * warp + g + 8 * (reg % 2), 16 * (reg // 2) + 4 * t + byte


def c_position(warp: int, g: int, t: int, index: int) -> tuple[int, int]:
    """(row, column) of accumulator register ``index``: CLayout_64xN."""
    j, rest = divmod(index, 4)
    r, e = divmod(rest, 2)
    return 16 * warp + g + 8 * r, 8 * j + 2 * t + e


def accumulator(matrix: torch.Tensor) -> dict[tuple[int, int, int], list]:
    """A 64 x N matrix as each thread (warp, g, t) holds it in wgmma's accumulator layout."""
    cols = matrix.shape[1]
    regs = {}
    for warp in range(WARPS):
        for g in range(8):
            for t in range(4):
                regs[warp, g, t] = [
                    matrix[c_position(warp, g, t, i)].item() for i in range(cols // 2)
                ]
    return regs


def from_accumulator(regs: dict[tuple[int, int, int], list], cols: int) -> torch.Tensor:
    out = torch.zeros(16 * WARPS, cols, dtype=torch.int64)
    for (warp, g, t), values in regs.items():
        for i, v in enumerate(values):
            out[c_position(warp, g, t, i)] = v
    return out


# --- P: accumulator -> A registers -------------------------------------------------------


def p8_sources(kk: int, reg: int, fp8_packing: bool = True) -> list[int]:
    """The accumulator registers convert_p8 packs into A register ``reg`` of k32 slice kk:
    a_(2h + r) = q4(s[8h + 2r], s[8h + 2r + 1], s[8h + 4 + 2r], s[8h + 5 + 2r]) (+ 16 kk); the
    16-bit kernel's order packs consecutive registers instead."""
    if not fp8_packing:
        return [16 * kk + 4 * reg + b for b in range(4)]
    h, r = divmod(reg, 2)
    first = 16 * kk + 8 * h + 2 * r
    return [first, first + 1, first + 4, first + 5]


def convert_p8(s: list, block_c: int, fp8_packing: bool = True) -> list[list]:
    """A thread's A registers, 4 per k32 slice, each a list of its 4 bytes (low first)."""
    return [
        [s[i] for i in p8_sources(kk, reg, fp8_packing)]
        for kk in range(block_c // 32)
        for reg in range(4)
    ]


def a_matrix(a_regs: dict[tuple[int, int, int], list[list]], block_c: int) -> torch.Tensor:
    """The 64 x B_c A operand wgmma reads from the threads' registers (k = slice position)."""
    a = torch.full((16 * WARPS, block_c), -1, dtype=torch.int64)
    for (warp, g, t), regs in a_regs.items():
        for kk in range(block_c // 32):
            for reg in range(4):
                for byte in range(4):
                    row, k = a_position(warp, g, t, reg, byte)
                    a[row, 32 * kk + k] = regs[4 * kk + reg][byte]
    assert (a >= 0).all(), "a position of A no register holds"
    return a


def key_at_position(block_c: int) -> list[int]:
    """The key each k position of P V carries: the P registers' order (§3.4)."""
    probe = torch.arange(block_c)[None, :].expand(16 * WARPS, -1)
    regs = accumulator(probe)
    a = a_matrix({w: convert_p8(s, block_c) for w, s in regs.items()}, block_c)
    return a[0].tolist()


# --- SMEM: panels and swizzles -----------------------------------------------------------


def swizzle(address: int, row_bytes: int) -> int:
    """TMA's and wgmma's swizzle of a byte address in a tile of ``row_bytes``-byte rows:
    the 16-byte chunk index XOR the row within the 1,024-byte (or 512-byte) atom."""
    if row_bytes == 128:
        return address ^ (((address >> 7) & 7) << 4)
    assert row_bytes == 64, row_bytes
    return address ^ (((address >> 7) & 3) << 4)


@dataclass(frozen=True)
class Panels:
    """A tile of ``rows`` rows of ``width`` bytes, stored in panels of ``panel`` bytes a row
    (TMA's boxes, wgmma's K-major panels), each panel swizzled on its own."""

    rows: int
    width: int
    panel: int

    def address(self, row: int, byte: int) -> int:
        p, within = divmod(byte, self.panel)
        return p * self.rows * self.panel + swizzle(row * self.panel + within, self.panel)

    @property
    def nbytes(self) -> int:
        return self.rows * self.width


def vt_panel(block_c: int) -> int:
    """Vt's row panel, in keys: 128 (128-byte swizzle), or 64 when B_c is not a multiple."""
    return 128 if block_c % 128 == 0 else 64


def raw_v_panels(block_c: int, head_dim: int) -> Panels:
    return Panels(block_c, head_dim, 64 if head_dim == 64 else 128)


def vt_panels(block_c: int, head_dim: int) -> Panels:
    return Panels(head_dim, block_c, vt_panel(block_c))


# --- the transpose ------------------------------------------------------------------------


def rho(column: int, on: bool = True) -> int:
    """Vt's physical row of head_dim column ``column``: within 16 columns, logical 2g + h sits
    at 8h + 2(g % 4) + g / 4, so that the 8 rows one stmatrix matrix writes are consecutive."""
    if not on:
        return column
    base, j = divmod(column, 16)
    g, h = divmod(j, 2)
    return 16 * base + 8 * h + 2 * (g % 4) + g // 4


def rho_inverse(row: int, on: bool = True) -> int:
    return next(c for c in range(16 * (row // 16), 16 * (row // 16) + 16) if rho(c, on) == row)


@dataclass(frozen=True)
class Unit:
    """One ldmatrix.x4.trans + stmatrix.x4 of a producer warp: matrix m reads 8 raw rows
    (keys) from key ``ld_keys[m]`` at byte ``ld_byte[m]``, and stmatrix's matrix m writes
    the 8 Vt rows of columns ``st_col[m] + 2g + h[m]``, 16 keys from key ``st_group[m]``."""

    keys: int
    cols: int
    ld_keys: tuple[int, ...]
    ld_byte: tuple[int, ...]
    st_col: tuple[int, ...]
    h: tuple[int, ...]
    st_group: tuple[int, ...]


# 16 keys x 32 columns; head_dim 64: 32 keys x 16 columns (a warp's 16 whole Vt rows)
WIDE = Unit(16, 32, (0, 8, 0, 8), (0, 0, 16, 16), (0, 0, 16, 16), (0, 1, 0, 1), (0, 0, 0, 0))
NARROW = Unit(32, 16, (0, 8, 16, 24), (0, 0, 0, 0), (0, 0, 0, 0), (0, 1, 0, 1), (0, 0, 16, 16))


def unit_of(head_dim: int) -> Unit:
    return NARROW if head_dim == 64 else WIDE


def prmt(a: list, b: list, selector: int) -> list:
    """prmt.b32 (default mode): byte i of the result is byte (selector >> 4i) & 7 of {b, a}."""
    both = a + b
    return [both[(selector >> (4 * i)) & 7] for i in range(4)]


def ldmatrix_x4_trans(smem: list, addresses: list[int]) -> dict[tuple[int, int], list[list]]:
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane 8m + i gives the address of row i
    of matrix m (16 bytes, 8 b16 elements); thread (g, t) receives, for each m, elements
    (2t, g) and (2t + 1, g) of matrix m: bytes [M[2t][2g], M[2t][2g+1], M[2t+1][2g],
    M[2t+1][2g+1]]."""
    out = {}
    for g in range(8):
        for t in range(4):
            regs = []
            for m in range(4):
                rows = [addresses[8 * m + 2 * t], addresses[8 * m + 2 * t + 1]]
                regs.append([smem[row + 2 * g + e] for row in rows for e in range(2)])
            out[g, t] = regs
    return out


def stmatrix_x4(smem: list, addresses: list[int], regs: dict[tuple[int, int], list[list]]):
    """stmatrix.sync.aligned.m8n8.x4.shared.b16: thread (g, t)'s register m is elements
    (g, 2t), (g, 2t + 1) of matrix m: bytes 4t..4t+3 of the row lane 8m + g addresses."""
    for (g, t), values in regs.items():
        for m in range(4):
            for byte in range(4):
                smem[addresses[8 * m + g] + 4 * t + byte] = values[m][byte]


def unit_addresses(head_dim: int, block_c: int, k0: int, d0: int, choices=DESIGN):
    """The 32 lanes' row addresses of one unit at keys k0, columns d0: (ldmatrix's into raw
    V, stmatrix's into Vt)."""
    unit = unit_of(head_dim)
    raw, vt = raw_v_panels(block_c, head_dim), vt_panels(block_c, head_dim)
    loads, stores = [], []
    for m in range(4):
        for i in range(8):
            loads.append(raw.address(k0 + unit.ld_keys[m] + i, d0 + unit.ld_byte[m]))
            column = d0 + unit.st_col[m] + 2 * i + unit.h[m]
            stores.append(vt.address(rho(column, choices.rho), k0 + unit.st_group[m]))
    return loads, stores


def warp_units(head_dim: int, block_c: int, warp: int) -> list[tuple[int, int]]:
    """The units (k0, d0) of producer warp ``warp``: all keys of its head_dim / 4 Vt rows."""
    unit = unit_of(head_dim)
    rows = head_dim // WARPS
    return [
        (k0, d0)
        for d0 in range(warp * rows, (warp + 1) * rows, unit.cols)
        for k0 in range(0, block_c, unit.keys)
    ]


def transpose_v(raw: list, head_dim: int, block_c: int, choices=DESIGN, trace=None) -> list:
    """The producer warps' transpose of one raw V slot (bytes, swizzled) into a Vt slot.
    ``trace`` (a list) receives (warp, ldmatrix addresses, stmatrix addresses) per unit."""
    vt = [None] * vt_panels(block_c, head_dim).nbytes
    for warp in range(WARPS):
        for k0, d0 in warp_units(head_dim, block_c, warp):
            loads, stores = unit_addresses(head_dim, block_c, k0, d0, choices)
            x = ldmatrix_x4_trans(raw, loads)
            if choices.prmt:
                y = {
                    lane: [
                        prmt(r[0], r[1], 0x6420),
                        prmt(r[0], r[1], 0x7531),
                        prmt(r[2], r[3], 0x6420),
                        prmt(r[2], r[3], 0x7531),
                    ]
                    for lane, r in x.items()
                }
            else:
                y = x
            stmatrix_x4(vt, stores, y)
            if trace is not None:
                trace.append((warp, loads, stores))
    return vt


def store_v(v: torch.Tensor) -> list:
    """V (B_c x head_dim bytes) as TMA writes it into its raw slot."""
    block_c, head_dim = v.shape
    layout = raw_v_panels(block_c, head_dim)
    smem = [None] * layout.nbytes
    for k in range(block_c):
        for c in range(head_dim):
            smem[layout.address(k, c)] = v[k, c].item()
    return smem


def read_vt(vt: list, head_dim: int, block_c: int) -> torch.Tensor:
    """Vt as the P V wgmma's K-major descriptor reads it: (physical row, k position)."""
    layout = vt_panels(block_c, head_dim)
    out = torch.zeros(head_dim, block_c, dtype=torch.int64)
    for row in range(head_dim):
        for k in range(block_c):
            value = vt[layout.address(row, k)]
            assert value is not None, f"Vt row {row} position {k} never written"
            out[row, k] = value
    return out


def conflicts(addresses: list[int]) -> int:
    """The wavefronts of one ldmatrix/stmatrix .x4: per matrix (8 rows of 16 bytes), the
    most rows whose 16 bytes fall in the same 16 bytes of the 128 bank bytes; 1 = none."""
    worst = 1
    for m in range(4):
        chunks = [(a % BANK_BYTES) // 16 for a in addresses[8 * m : 8 * m + 8]]
        worst = max(worst, max(chunks.count(c) for c in chunks))
    return worst


# --- O -----------------------------------------------------------------------------------


def unpermute_o(o: list) -> list:
    """Swap o[8J + 2r + 1] and o[8J + 4 + 2r] in every 16 columns J (r < 2): a renaming."""
    out = list(o)
    for base in range(0, len(o), 8):
        for r in range(2):
            a, b = base + 2 * r + 1, base + 4 + 2 * r
            out[a], out[b] = o[b], o[a]
    return out


def p_times_v(p: torch.Tensor, v: torch.Tensor, choices=DESIGN) -> torch.Tensor:
    """O = P V as the FP8 kernel computes it for one warpgroup's 64 rows: P (64 x B_c,
    integers) in the accumulator, packed by convert_p8; V (B_c x head_dim, bytes) by TMA
    into its raw slot, transposed into Vt; one RS wgmma per k32 slice over K-major Vt; O's
    registers unpermuted and read in the accumulator layout."""
    block_c, head_dim = v.shape
    s = accumulator(p)
    a = a_matrix(
        {w: convert_p8(regs, block_c, choices.fp8_packing) for w, regs in s.items()}, block_c
    )
    vt = read_vt(transpose_v(store_v(v), head_dim, block_c, choices), head_dim, block_c)
    d = a @ vt.T  # D(row, n) = sum over k of A(row, k) B(k, n), B K-major: Vt(n, k)
    o = accumulator(d)
    if choices.unpermute:
        o = {w: unpermute_o(regs) for w, regs in o.items()}
    return from_accumulator(o, head_dim)
