"""The FP8 forward's layouts (tests/fp8_layout_model.py, research/fp8-forward.md §3.3-§3.4,
§6 test 2): for every thread, k32 slice, B_c and head_dim, the modelled P V of integer P and
V equals P @ V exactly, with no lane and no byte moved between the softmax and the wgmma;
removing any one of the design's choices breaks the product, or (rho) the stores' banks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp8_layout_model as model
from fadsl.targets.sm90.transpose_agents import vt_panel_keys, vt_warp_spans
from fp8_layout_model import DESIGN, Choices

BLOCKS_C = (64, 128, 192, 256)
HEAD_DIMS = (64, 128, 256)


def operands(block_c: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer P (64 x B_c) and V (B_c x head_dim) with distinct-ish values, so that any
    permutation of keys or columns changes P @ V."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 16, (64, block_c), generator=gen)
    v = torch.randint(0, 256, (block_c, head_dim), generator=gen)
    return p, v


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_c", BLOCKS_C)
def test_p_v_is_exact(block_c, head_dim):
    p, v = operands(block_c, head_dim)
    assert torch.equal(model.p_times_v(p, v), p @ v)


def test_the_key_order_of_a_k32_slice():
    """§3.4's table: k position -> key, 0-3: 0 1 8 9; 4-7: 2 3 10 11; ...; + 16 for 16-31."""
    first = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    assert model.key_at_position(64) == [
        32 * kk + 16 * half + k for kk in range(2) for half in range(2) for k in first
    ]


def test_the_worked_example_of_lane_5():
    """§3.4: lane 5 of warp 0 (g = 1, t = 1), kk = 0: a0 holds s0 s1 s4 s5, row 1, keys 2, 3,
    10, 11, which wgmma reads as A(1, 4..7); a2 s8 s9 s12 s13, keys 18, 19, 26, 27."""
    assert [model.p8_sources(0, r) for r in range(4)] == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
        [8, 9, 12, 13],
        [10, 11, 14, 15],
    ]
    assert [model.c_position(0, 1, 1, i) for i in (0, 1, 4, 5)] == [
        (1, 2),
        (1, 3),
        (1, 10),
        (1, 11),
    ]
    assert [model.a_position(0, 1, 1, 0, b) for b in range(4)] == [(1, k) for k in range(4, 8)]
    assert [model.c_position(0, 1, 1, i)[1] for i in (8, 9, 12, 13)] == [18, 19, 26, 27]
    assert [model.a_position(0, 1, 1, 2, b)[1] for b in range(4)] == [20, 21, 22, 23]


def test_no_lane_moves_p():
    """Every byte of each thread's A registers comes from that thread's own accumulator."""
    block_c = 128
    probe = torch.arange(64 * block_c).reshape(64, block_c)
    s = model.accumulator(probe)
    for lane, regs in s.items():
        packed = model.convert_p8(regs, block_c)
        assert {b for reg in packed for b in reg} <= set(regs), lane


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_c", BLOCKS_C)
def test_the_transpose_writes_keys_in_p_order(block_c, head_dim):
    """Vt's physical row rho(c), position k, holds V(key_at_position(k), c)."""
    _, v = operands(block_c, head_dim, seed=1)
    vt = model.read_vt(model.transpose_v(model.store_v(v), head_dim, block_c), head_dim, block_c)
    keys = model.key_at_position(block_c)
    for c in range(head_dim):
        assert vt[model.rho(c)].tolist() == [v[k, c].item() for k in keys], c


@pytest.mark.parametrize(
    "removed",
    [
        Choices(fp8_packing=False),  # P packed in the 16-bit order
        Choices(prmt=False),  # Vt's keys as ldmatrix.trans returns them
        Choices(unpermute=False),  # O's columns left in rho's order
        Choices(rho=False),  # rows in natural order, O still swapped
    ],
    ids=["packing", "prmt", "unpermute", "rho"],
)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_each_choice_removed_breaks_p_v(removed, head_dim):
    p, v = operands(128, head_dim, seed=2)
    assert not torch.equal(model.p_times_v(p, v, removed), p @ v)


def test_rho_and_the_swap_go_together():
    """Without rho and without the swap O is right again: rho buys only the banks."""
    p, v = operands(128, 128, seed=3)
    assert torch.equal(model.p_times_v(p, v, Choices(rho=False, unpermute=False)), p @ v)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_c", BLOCKS_C)
def test_the_transpose_is_free_of_bank_conflicts(block_c, head_dim):
    """ldmatrix reads 8 consecutive raw rows per matrix, stmatrix writes 8 consecutive Vt rows
    per matrix (rho); without rho every stmatrix is a 2-way conflict (ML's 1,150 against
    1,200 TFLOPS)."""
    _, v = operands(block_c, head_dim)
    trace = []
    model.transpose_v(model.store_v(v), head_dim, block_c, trace=trace)
    assert {model.conflicts(loads) for _, loads, _ in trace} == {1}
    assert {model.conflicts(stores) for _, _, stores in trace} == {1}
    trace = []
    model.transpose_v(model.store_v(v), head_dim, block_c, Choices(rho=False), trace=trace)
    assert {model.conflicts(stores) for _, _, stores in trace} == {2}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("block_c", BLOCKS_C)
def test_each_warp_writes_only_its_own_vt_rows(block_c, head_dim):
    """Warp w writes the rows [w d/4, (w + 1) d/4) of each panel, whole swizzle atoms: what
    verify's producer-warp agents claim (fadsl/targets/sm90/transpose_agents.py)."""
    _, v = operands(block_c, head_dim)
    trace = []
    model.transpose_v(model.store_v(v), head_dim, block_c, trace=trace)
    layout = model.vt_panels(block_c, head_dim)
    rows, panel = head_dim // model.WARPS, layout.panel
    written = {w: set() for w in range(model.WARPS)}
    for warp, _, stores in trace:
        for address in stores:
            written[warp].update(range(address, address + 16))
    assert panel == vt_panel_keys(block_c)
    for warp, addresses in written.items():
        expected = set()
        for p in range(block_c // panel):
            lo = p * head_dim * panel + warp * rows * panel
            expected.update(range(lo, lo + rows * panel))
        assert addresses == expected, warp
        spans = vt_warp_spans(head_dim, block_c, warp)  # what verify's agents claim
        assert addresses == {b for lo, hi in spans for b in range(lo, hi)}, warp


def test_rho_is_a_permutation_of_each_16_columns():
    for on in (True, False):
        assert sorted(model.rho(c, on) for c in range(256)) == list(range(256))
        assert all(model.rho_inverse(model.rho(c, on), on) == c for c in range(256))
        assert all(model.rho(c, on) // 16 == c // 16 for c in range(256))


def test_unpermute_o_is_the_inverse_of_rho_on_the_accumulator():
    """O's register i of thread t holds physical column c_position; after the swap, its true
    column is rho^-1 of it everywhere."""
    for t in range(4):
        for i in range(128):
            swapped = model.unpermute_o(list(range(128)))[i]
            physical = model.c_position(0, 0, t, swapped)[1]
            assert model.rho_inverse(physical) == model.c_position(0, 0, t, i)[1]


def test_prmt_selectors():
    """0x6420 takes the even bytes of {b, a}, 0x7531 the odd ones."""
    a, b = [0, 1, 2, 3], [4, 5, 6, 7]
    assert model.prmt(a, b, 0x6420) == [0, 2, 4, 6]
    assert model.prmt(a, b, 0x7531) == [1, 3, 5, 7]


@settings(max_examples=12, deadline=None)
@given(
    block_c=st.sampled_from(BLOCKS_C),
    head_dim=st.sampled_from(HEAD_DIMS),
    seed=st.integers(0, 2**31),
    extreme=st.booleans(),
)
def test_random_operands(block_c, head_dim, seed, extreme):
    """Any P and V bytes (0 and 255 in bulk when ``extreme``)."""
    p, v = operands(block_c, head_dim, seed)
    if extreme:
        v = torch.where(v % 3 == 0, torch.zeros_like(v), torch.full_like(v, 255))
    assert torch.equal(model.p_times_v(p, v, DESIGN), p @ v)


def lean_addresses(warp: int, c: int, k0: int, head_dim: int = 256, block_c: int = 128):
    """transpose_v_lean's lane addresses (fadsl/sm90_fp8.cuh, its arithmetic line for line,
    slots at 0) for the unit of columns c.. and keys k0..: (ldmatrix.x4's 32, each
    stmatrix.x2's 16: lanes 0-15 address both, the second 16 P bytes further)."""
    rows, panel = head_dim // 4, model.vt_panel(block_c)
    raw_panel_bytes, vt_panel_bytes = block_c * 128, head_dim * panel
    loads, stores = [], []
    for lane in range(32):
        h, m, i = lane // 16, lane // 8 % 2, lane % 8
        swizzle_row = model.rho(2 * i + m) % 8
        st_xor = 16 * (swizzle_row if panel == 128 else swizzle_row // 2)
        raw0 = (
            (warp * rows // 128) * raw_panel_bytes
            + (8 * m + i) * 128
            + ((warp * rows % 128) ^ (16 * i) ^ (16 * h))
        )
        vt0 = (warp * rows + model.rho(2 * i + m)) * panel + st_xor
        loads.append((raw0 ^ c) + k0 * 128)
        dst = ((vt0 + c * panel) ^ (k0 % panel)) + (k0 // panel) * vt_panel_bytes
        stores.append(dst)
    halves = (stores[:16], [a + 16 * panel for a in stores[:16]])
    return loads, halves


@pytest.mark.parametrize("block_c", [128, 64])
def test_transpose_v_lean_moves_the_units_bytes(block_c):
    """Each unit of transpose_v_lean loads exactly transpose_v_units' ldmatrix.x4 addresses and
    stores through two stmatrix.x2 the x4 store's matrices 0-1 and 2-3 (lanes 0-15 and
    16-31 of unit_addresses), over each warp's units once: the same bytes to the same places
    as the layout model's transpose (head_dim 256; B_c 64 writes Vt in 64-key panels with the
    64-byte swizzle)."""
    for warp in range(model.WARPS):
        seen = []
        for c in (0, 32):  # the kernel's loops
            for k0 in range(0, block_c, 16):
                loads, (first, second) = lean_addresses(warp, c, k0, block_c=block_c)
                d0 = warp * 64 + c
                ref_loads, ref_stores = model.unit_addresses(256, block_c, k0, d0)
                assert loads == ref_loads, (warp, c, k0)
                assert first == ref_stores[:16] and second == ref_stores[16:], (warp, c, k0)
                seen.append((k0, d0))
        assert sorted(seen) == sorted(model.warp_units(256, block_c, warp))


def narrow_addresses(warp: int, k0: int, block_c: int):
    """transpose_v_narrow's lane addresses (fadsl/sm90_fp8.cuh, its arithmetic line for line,
    slots at 0) for the unit at keys k0: (ldmatrix.x4's 32, stmatrix.x4's 32)."""
    panel, row = model.vt_panel(block_c), 64
    vt_panel_bytes = 64 * panel
    loads, stores = [], []
    for lane in range(32):
        m, i, d0 = lane // 8, lane % 8, 16 * warp
        raw = (8 * m + i) * row + (d0 ^ (16 * (i % 8 // 2)))
        st_row = model.rho(d0 + 2 * i + m % 2)
        st_xor = 16 * (st_row % 8 if panel == 128 else st_row % 8 // 2)
        st_xor ^= 16 * (m // 2)
        vt = st_row * panel
        loads.append(raw + k0 * row)
        stores.append(vt + (k0 // panel) * vt_panel_bytes + ((k0 % panel) ^ st_xor))
    return loads, stores


@pytest.mark.parametrize("block_c", BLOCKS_C)
def test_transpose_v_narrow_is_the_models_head_dim_64_transpose(block_c):
    """transpose_v_narrow (head_dim 64: 32-key x 16-column units, raw rows of 64 bytes in the
    64-byte swizzle) addresses exactly the layout model's units, each warp the units of its
    own 16 Vt rows once: the transpose the model proves exact and conflict-free."""
    for warp in range(model.WARPS):
        units = model.warp_units(64, block_c, warp)
        assert [k0 for k0, _ in units] == list(range(0, block_c, 32))  # the kernel's loop
        for k0, d0 in units:
            assert d0 == 16 * warp
            assert narrow_addresses(warp, k0, block_c) == model.unit_addresses(64, block_c, k0, d0)
