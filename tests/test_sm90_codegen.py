"""sm_90a: the sync plan the pass derives, its rendering, the knobs, and nvcc compile checks."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT
from fadsl.codegen.render import render, write
from fadsl.ir import Parity, Sync, Threads
from fadsl.ir.ops import Op
from fadsl.pipeline import compile_file, compile_source
from fadsl.build.nvrtc import nvcc
from fadsl.targets.sm90 import caps

SPECS = (
    # (16-bit kernels: tests/test_fp8_codegen.py checks the 8-bit ones, examples/fa3_fp8_*
    # and examples/serving/fa3_fp8_*)
    sorted(p for p in (ROOT / "examples").glob("fa3_*.fa") if not p.stem.startswith("fa3_fp8"))
    + sorted(
        p for p in (ROOT / "examples" / "serving").glob("*.fa") if not p.stem.startswith("fa3_fp8")
    )
    + sorted((ROOT / "tests" / "specs" / "sm90").glob("*.fa"))
)
IDS = [p.stem for p in SPECS]
HOPPER = (ROOT / "examples" / "fa3_hopper.fa").read_text()


def _kinds(kernel, who=None):
    return [
        (s.kind.name, s.barrier, s.lag, s.parity, s.groups)
        for s in kernel.syncs()
        if who is None or s.who in who
    ]


def test_the_plan_is_the_prototypes():
    """fa3_hopper's consumer mainloop, without `cluster 2` and with `rescale lazy`, is the
    hand-written prototype's (its NOTES.md's sync-plan table, archived with it: git tag
    archive/bench-history-and-prototypes); tests/test_cluster_syncs.py has what the
    cluster adds, test_rescale_guarded_... what `rescale guarded` moves (K's release)."""
    text = Path("tests/specs/bench/fa3_hopper_cluster_off.fa").read_text()
    kernel = compile_source(
        re.sub(r"^  rescale +\w+", "  rescale    lazy", text, flags=re.M)
    ).kernel
    loop = [
        (i.kind.name, i.barrier, i.groups) if isinstance(i, Sync) else i.op.spelling
        for i in kernel.mainloop
        if i.who not in (Threads.PRODUCER_THREAD,)
    ]
    assert loop == [
        ("mbarrier.try_wait.parity", "k_full", 0),
        ("bar.sync", "turn", 0),
        ("wgmma.fence", "", 0),
        "qk",
        ("wgmma.commit_group", "", 0),
        "rescale_o",
        ("mbarrier.try_wait.parity", "v_full", 0),
        ("wgmma.fence", "", 0),
        "pv",
        ("wgmma.commit_group", "", 0),
        ("bar.arrive", "turn", 0),
        ("wgmma.wait_group", "", 1),
        ("mbarrier.arrive", "k_empty", 0),
        "softmax",
        ("wgmma.wait_group", "", 0),
        ("mbarrier.arrive", "v_empty", 0),
        "convert_p",
    ]
    producer = _kinds(kernel, (Threads.PRODUCER_THREAD,))
    # the producer waits for the previous round with the flipped parity, then arms the full barrier
    assert ("mbarrier.try_wait.parity", "k_empty", 0, Parity.PHASE_FLIP, 0) in producer
    assert ("mbarrier.try_wait.parity", "v_empty", -1, Parity.PHASE_FLIP, 0) in producer
    turns = [s for s in kernel.syncs() if s.barrier == "turn"]
    assert {(s.kind.name, s.bar_id, s.peer, s.count) for s in turns} == {
        ("bar.arrive", 5, None, 256),  # the last warpgroup opens warpgroup 0's turn
        ("bar.sync", 5, 0, 256),
        ("bar.arrive", 5, 1, 256),
        ("bar.sync", 5, None, 256),  # warpgroup 0 takes the final hand-over
    }
    every = {s.kind for s in kernel.syncs()}
    assert {caps.FENCE_PROXY_ASYNC, caps.BULK_WAIT, caps.MBAR_INIT, caps.SYNCTHREADS} <= every


def test_off_knobs_drop_turns_and_wait_after_each_gemm():
    text = HOPPER.replace("pingpong   on", "pingpong   off").replace(
        "overlap    on", "overlap    off", 1  # the forward's (the backward block's stays)
    )
    kernel = compile_source(text).kernel
    assert not [s for s in kernel.syncs() if s.barrier == "turn"]
    waits = [s.groups for s in kernel.syncs() if s.kind == caps.WGMMA_WAIT]
    assert waits and set(waits) == {0}
    # each GEMM is followed by its wait before anything else is issued
    loop = kernel.mainloop
    for i, item in enumerate(loop):
        if getattr(item, "op", None) is not None and item.async_kind == caps.WGMMA:
            assert loop[i + 1].kind == caps.WGMMA_COMMIT and loop[i + 2].kind == caps.WGMMA_WAIT


def test_ring_barriers_count_consumer_warps_and_o_has_its_own_bytes():
    kernel = compile_file("examples/fa3_hdim64.fa").kernel
    inits = {s.barrier: s.count for s in kernel.syncs() if s.kind == caps.MBAR_INIT}
    assert inits == {
        **{"q_full": 1, "q_empty": 12},  # per tile: Q loaded, Q read
        **{"k_full": 1, "k_empty": 12, "v_full": 1, "v_empty": 12},
    }
    v, o = kernel.buffer("V"), kernel.buffer("O")
    assert o.offset >= v.offset + v.nbytes  # O's own bytes: they fit
    assert kernel.buffer("K").slots == v.slots == 2
    assert not [s for s in kernel.syncs() if s.barrier in ("ring_dead", "o_free")]
    # the previous tile's O store before this tile's stmatrix: waited for a tile late, by the
    # thread that issued it, just before the tile's last turn (a bar.sync of the warpgroup)
    epilogue = list(kernel.epilogue)
    last_turn = next(s for s in epilogue if isinstance(s, Sync) and s.kind is caps.BAR_SYNC)
    wait = epilogue[epilogue.index(last_turn) - 1]
    assert last_turn.barrier == "turn" and "o_s2g -> o_r2s" in last_turn.serves[0].describe()
    assert wait.kind is caps.BULK_WAIT and wait.who is Threads.CONSUMER_ELECTED
    assert wait.groups == 0 and wait.serves == last_turn.serves
    # not right after the store (it would hold the warpgroup's next turn), once more at exit
    store = next(i for i, s in enumerate(epilogue) if getattr(s, "op", None) is Op.O_S2G)
    assert [s.kind for s in epilogue[store + 1 :]] == [caps.BULK_COMMIT]
    assert [(s.kind, s.who) for s in kernel.teardown if s.kind is caps.BULK_WAIT] == [
        (caps.BULK_WAIT, Threads.CONSUMER_ELECTED)
    ]
    turns = [s for s in kernel.prologue if isinstance(s, Sync) and s.kind is caps.BAR_SYNC]
    assert turns and not any(s.serves for s in turns)  # the first turn orders nothing now


def test_o_over_the_v_ring_when_its_own_bytes_do_not_fit():
    kernel = compile_file("examples/fa3_hdim256.fa").kernel  # 128 x 80, d256: 225 KiB
    inits = {s.barrier: s.count for s in kernel.syncs() if s.kind == caps.MBAR_INIT}
    assert inits["o_free"] == 2  # one arrival per consumer warpgroup: its store has read O
    assert kernel.buffer("O").offset == kernel.buffer("V").offset
    ring_dead = [s for s in kernel.syncs() if s.barrier == "ring_dead"]
    assert [s.count for s in ring_dead] == [128 * 2] and ring_dead[0].serves


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_every_sync_is_rendered_with_its_hazards(spec):
    compiled = compile_file(spec.relative_to(ROOT))
    text = render(compiled.kernel, compiled.target, compiled.file)[0].text
    assert f"from {spec.relative_to(ROOT)}" in text
    ctas = compiled.kernel.config.ext.ctas_per_sm  # `ctas_per_sm`: the bounds' minimum
    assert re.search(
        rf'extern "C" __global__ void __launch_bounds__\(Cfg::kThreads, {ctas}\) '
        r"\w+\(const __grid_constant__ FwdParamsSm90 P\)",
        text,
    )
    assert re.search(r'extern "C" __device__ const int \w+_launch_info\[5\]', text)
    for sync in compiled.kernel.syncs():
        for hazard in sync.serves:
            assert f"// hazard {hazard.describe()}" in text
        if sync.note:
            assert sync.note in text
    calls = len(
        re.findall(
            r"\b(mbar_wait_parity|mbar_arrive|mbar_arrive_expect_tx|wgmma_wait<\d>|named_bar_sync|named_bar_arrive|fence_proxy_async_smem)\(",
            text,
        )
    )
    planned = [
        s
        for s in compiled.kernel.syncs()
        if s.kind
        in (
            caps.MBAR_WAIT,
            caps.MBAR_ARRIVE,
            caps.MBAR_EXPECT_TX,
            caps.WGMMA_WAIT,
            caps.BAR_SYNC,
            caps.BAR_ARRIVE,
            caps.FENCE_PROXY_ASYNC,
        )
    ]
    assert calls == len(planned)


def builds_without_spills(cu: Path, out: Path) -> list[str]:
    """nvcc builds ``cu`` (its headers in ``out``) for sm_90a with no spill and no warning;
    the flags it used."""
    flags = ["-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", f"-I{out}"]
    res = subprocess.run(
        [nvcc(), *flags, "-cubin", "--resource-usage", "-o", str(out / "k.cubin"), str(cu)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    log = res.stdout + res.stderr
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    assert "warning" not in log.lower(), log
    return flags


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_sm90a_kernels_compile_without_spills_to_hopper_ptx(spec):
    compiled = compile_file(spec.relative_to(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        paths = [
            p
            for p in write(compiled.kernel, compiled.target, compiled.file, out)
            if p.suffix == ".cu"
        ]
        for cu in paths:
            flags = builds_without_spills(cu, out)
            ptx = subprocess.run(
                [nvcc(), *flags, "-ptx", "-o", "-", str(cu)], capture_output=True, text=True
            ).stdout
            # the forward stores O by stmatrix; the backward reduce-adds dQ in bulk, or from
            # registers where its spec's dQ path is `rf -red.add-> gmem`
            last = "stmatrix"
            if "_bwd_" in cu.name:
                dq_red = compiled.kernel.backward.dq_red
                last = "red.global.add.v4.f32" if dq_red else "cp.reduce.async.bulk"
            for instr in (
                "wgmma.mma_async",
                "cp.async.bulk.tensor",
                "mbarrier",
                "setmaxnreg",
                last,
            ):
                assert instr in ptx, (cu.name, instr)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_only_the_consumers_take_the_tile_index_through_a_warp_shuffle(spec):
    """The consumers' tile loop reads the tile index through warp_uniform (a full-warp
    shuffle, so that ptxas keeps the tile's values in uniform registers); the producer's loop
    runs in one elected lane, where a full-warp shuffle would never complete."""
    compiled = compile_file(spec.relative_to(ROOT))
    text = render(compiled.kernel, compiled.target, compiled.file)[0].text
    producer = text[text.index("producer warpgroup") : text.index("consumer warpgroups")]
    consumers = text[text.index("consumer warpgroups") :]
    assert "if (warp == 0 && elect_one()) {" in producer
    assert "warp_uniform(" not in producer
    loops = re.findall(r"for \(int step = 0, tile; \(tile = (.*)\) >= 0; \+\+step\)", consumers)
    hw = compiled.kernel.config.ext
    index = (
        "split_tile_index<Cfg>(P, step)"
        if hw.split_kv
        else "varlen_tile_index<Cfg>(P, step)" if hw.varlen else "tile_index<Cfg>(P.base, step)"
    )
    assert loops == [f"warp_uniform({index})"]


def _with_rescale(mode: str) -> str:
    text, n = re.subn(r"^  rescale +\w+", f"  rescale    {mode}", HOPPER, flags=re.M)
    assert n == 1
    return text


def test_rescale_knob_reaches_the_kernel_config():
    """`rescale lazy` is the default; `every` is FlashAttention-3's per-block rescale;
    `guarded` is lazy for the header's rescale_o. The Cfg's last template argument says
    whether O's multiply may be skipped."""
    silent = re.sub(r"^  rescale .*\n", "", HOPPER, flags=re.M)
    assert silent != HOPPER
    configs = {}
    texts = {
        "silent": silent,
        **{mode: _with_rescale(mode) for mode in ("lazy", "every", "guarded")},
    }
    for name, text in texts.items():
        compiled = compile_source(text)
        hw = compiled.kernel.config.ext
        assert hw.lazy_rescale is (name != "every") and hw.guarded is (name == "guarded")
        cuda = render(compiled.kernel, compiled.target, compiled.file)[0].text
        configs[name] = re.search(r"struct Cfg : FwdConfig<([^>]*)>", cuda).group(1)
        assert f"rescale {'lazy' if name == 'silent' else name}" in cuda
    assert configs["lazy"] == configs["silent"] == configs["guarded"]
    assert configs["lazy"].endswith(", true") and configs["every"].endswith(", false")


def test_rescale_guarded_renders_the_guarded_softmax_in_the_mainloop_only():
    """`rescale guarded`: the tile's first block and the masked blocks take the row max
    (online_softmax), the mainloop's others the guarded softmax, whose rare recompute of S
    runs before P is converted and before the K slot's empty arrival."""
    compiled = compile_source(_with_rescale("guarded"))
    hw = compiled.kernel.config.ext
    assert hw.guarded and hw.lazy_rescale and hw.rescale == "guarded"
    cuda = render(compiled.kernel, compiled.target, compiled.file)[0].text
    assert "rescale guarded" in cuda
    assert cuda.count("online_softmax_guarded<Cfg>") == 1
    assert cuda.count("softmax_redo<Cfg>") == 1
    start = cuda.index("auto iteration = [&]")
    loop = cuda[start : cuda.index("int it = 1;", start)]
    assert "online_softmax_guarded" in loop and "online_softmax<Cfg>" in loop  # masked blocks
    redo, convert = loop.index("softmax_redo<Cfg>"), loop.index("convert_p<Cfg>(s, p)")
    release = loop.index("mbar_arrive(bar_k_empty")
    assert loop.index("online_softmax_guarded") < redo < convert < release
    lazy = compile_source(_with_rescale("lazy"))
    cuda = render(lazy.kernel, lazy.target, lazy.file)[0].text
    assert "online_softmax_guarded" not in cuda and "softmax_redo" not in cuda


def test_q_slots_render_a_ring_of_tiles():
    """q_slots 2: two Q slots and two barrier pairs, indexed by the CTA's tile count, in the
    producer's load and the consumers' wgmma descriptors; q_slots 1 renders none of it."""
    compiled = compile_file("tests/specs/sm90/fa3_q_ring.fa")
    text = render(compiled.kernel, compiled.target, compiled.file)[0].text
    assert "static constexpr int kNumBars = 12;" in text
    assert "for (int s = 0; s < 2; ++s) mbar_init(bar_q_full(s), 1);" in text
    assert "for (int s = 0; s < 2; ++s) mbar_init(bar_q_empty(s), 12);" in text
    assert (
        "load_q<Cfg>(P, smem_q + (tile_count % 2) * Cfg::kQBytes, bar_q_full(tile_count % 2), w);"
        in text
    )
    assert "mbar_wait_parity(bar_q_empty(tile_count % 2), tile_phase(tile_count / 2) ^ 1u);" in text
    assert "mbar_wait_parity(bar_q_full(tile_count % 2), tile_phase(tile_count / 2));" in text
    assert "if (lane == 0) mbar_arrive(bar_q_empty(tile_count % 2));" in text
    # the consumers' slots of Q: each slot's address before the tile loop, the tile's slot
    # selected inside it (a select, not a multiply: ptxas then keeps the mainloop's schedule)
    loop = text.index("for (int step = 0, tile;", text.index("consumer warpgroups"))
    for s in (0, 1):
        base = f"smem_q_wg_slot{s} = smem_q + {s} * Cfg::kQBytes + wg * 64 * Cfg::kInRowBytes;"
        assert text.index(base) < loop
    select = "smem_q_wg = (tile_count & 1) ? smem_q_wg_slot1 : smem_q_wg_slot0;"
    assert loop < text.index(select)
    assert "(tile_count % 2) * Cfg::kQBytes + wg" not in text
    plain = compile_file("examples/fa3_hdim64.fa")
    single = render(plain.kernel, plain.target, plain.file)[0].text
    assert "tile_count %" not in single and "kQBytes" not in single


Q_RING_SPECS = sorted((ROOT / "tests" / "specs" / "bench").glob("*_q2*.fa"))


@pytest.mark.parametrize("spec", SPECS + Q_RING_SPECS, ids=[p.stem for p in SPECS + Q_RING_SPECS])
def test_every_mbarrier_has_bytes_of_its_own(spec):
    """Every bar_* the kernel defines, at every slot it is used with (a K/V ring's stages,
    a ring of tiles' slots), is a distinct 8-byte mbarrier inside [0, kNumBars)."""
    compiled = compile_file(spec.relative_to(ROOT))
    text = render(compiled.kernel, compiled.target, compiled.file)[0].text
    stages = int(re.search(r"FwdConfig<[^,]+, \d+, \d+, \d+, (\d+),", text).group(1))
    count = int(re.search(r"static constexpr int kNumBars = (\d+);", text).group(1))
    indices = []
    for name, expr, tiles in re.findall(
        r"bar_(\w+) = (?:\[&\]\(int s\) \{ return )?smem \+ Cfg::kOffBar \+ 8 \* (.+?);"
        r"(?: \};)?(?:  // a ring of (\d+) tiles)?\n",
        text,
    ):
        ring = "s" in expr
        slots = int(tiles) if tiles else stages if ring else 1
        for s in range(slots):
            indices.append((eval(expr, {"s": s}), f"{name}[{s}]"))  # noqa: S307 (our own text)
    inits = len(re.findall(r"mbar_init\(", text))
    assert inits and len(indices) >= inits
    values = sorted(i for i, _ in indices)
    assert values == list(range(count)), indices


def test_the_register_pool_is_the_launch_allocation_in_whole_units():
    """setmaxnreg moves registers within the CTA's launch allocation: threads x the most
    registers a thread can have, in units of 8 (ptxas: 168 at 384 threads, not 170)."""
    from fadsl.targets.sm90.caps import default_registers, launch_registers, register_pool

    assert [launch_registers(t) for t in (256, 384, 512, 640)] == [256, 168, 128, 96]
    assert [register_pool(t) for t in (384, 512, 640)] == [64512, 65536, 61440]
    for consumers in (1, 2, 3):  # FlashAttention-3's splits fit their pools
        producer, consumer = default_registers(consumers)
        assert 128 * producer + 128 * consumers * consumer <= register_pool(128 * (1 + consumers))
