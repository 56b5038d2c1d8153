"""sm_90a's checks of a spec: what TMA, wgmma and warp specialisation allow, with located errors.

- head_dim 64, 128 or 256; B_c a multiple of 16 up to 256 (wgmma's N for S = Q K^T and
  TMA's box rows); B_r = 64 x consumer warpgroups (wgmma's M per warpgroup);
- warpgroups: one producer and 1 to 3 consumers; setmaxnreg values multiples of 8 in
  [24, 256] whose total over the CTA fits the SM's 64K registers, and a consumer
  budget that holds the consumer's register tiles (``consumer_registers``, an estimate;
  nvcc's 0-spill check is the real guard);
- the SMEM plan (Q + 2 x stages x B_c x d x 2 bytes + mbarriers) fits 227 KiB;
- paths: Q, K, V gmem -tma-> smem -wgmma-> rf (wgmma reads the SMEM tile through a
  descriptor), O rf -stmatrix-> smem -tma-> gmem; Q and O warpgroup-scoped, K and V
  CTA-scoped; `swizzle 128B` (TMA's and wgmma's layout);
- ping-pong needs two consumer warpgroups; the schedule is set by `pingpong` and
  `overlap`, not by a mainloop block;
- a sliding window (`mask window(...)`) with `cluster 1` and `tail whole` (both pair or
  split tiles by the K/V blocks they share, which a window's tiles do not); so does
  `varlen on`, whose tiles run longest first across the packed sequences.
- 8-bit dtypes (e4m3, e5m2): V transposed in SMEM, O written as `output bf16|fp16`, and
  what the first FP8 forward leaves out refused (fp8.py).
TMA's 16-byte stride and alignment rules concern the tensors: the runtime checks them.
"""

from __future__ import annotations

from ...spec.checks import Checks, and_list
from ...ir import AliasPolicy, Config, Instr, Level, Mask, Rescale, Role, Scope, Tensor
from .config import Sm90Config
from .fp8 import eight_bit, out_dtype, untransposed_v, validate_fp8, validate_transpose
from .modifiers import validate_modifiers
from ...spec.syntax import PathDecl
from .caps import (
    CAPABILITIES,
    HEAD_DIMS,
    MAX_CONSUMERS,
    PANEL_COLUMNS,
    REGISTER_UNIT,
    ROWS_PER_CONSUMER,
    SETMAXNREG_RANGE,
    SMEM_RESERVED_PER_CTA,
    WARPGROUP_THREADS,
    default_registers,
    launch_registers,
    register_pool,
    registers_asked,
    smem_limit,
)

SCOPES = {Role.Q: Scope.WARPGROUP, Role.K: Scope.CTA, Role.V: Scope.CTA, Role.O: Scope.WARPGROUP}
OVERHEAD_REGS = 24  # softmax state, addresses, loop counters: an estimate


def smem_bytes(
    block_r: int, block_c: int, head_dim: int, stages: int, q_slots: int = 1, fp8: bool = False
) -> int:
    """The plan's size: Q's slots, the K and V rings, 1 + 2 x q_slots + 4 x stages
    mbarriers, 1024 bytes of alignment slack (the least it can be: O over the dead V ring).
    ``fp8``: 1-byte tiles, and the transposed V's ring (Vt) beside V's, with its 2 mbarriers
    a slot (research/fp8-forward.md §3.2)."""
    rings = 3 if fp8 else 2
    tiles = (q_slots * block_r + rings * stages * block_c) * head_dim * (1 if fp8 else 2)
    return tiles + 8 * (1 + 2 * q_slots + 2 * rings * stages) + 1024


def consumer_registers(
    head_dim: int, block_c: int, overlap: bool, fp8: bool = False
) -> list[tuple[str, int]]:
    """Registers per consumer thread live at once: O's and S's fp32 accumulators (a
    warpgroup's 64 rows over 128 threads: d/2 and B_c/2) and, with overlap, P(j) as 16-bit
    pairs (B_c/4; ``fp8``: 8-bit quads, B_c/8) while S(j+1) is in flight."""
    parts = [("O accumulators", head_dim // 2), ("S accumulators", block_c // 2)]
    if overlap:
        p_regs = block_c // 8 if fp8 else block_c // 4
        parts.append(("P of the previous block, held during S (overlap on)", p_regs))
    parts.append(("softmax state and addresses", OVERHEAD_REGS))
    return parts


def validate(c: Checks, tensors: dict[Role, Tensor]) -> bool:
    v = c.values
    ok = True
    head_dim = v["head_dim"]
    block_r, block_c = v["tile"]["B_r"], v["tile"]["B_c"]
    if head_dim not in HEAD_DIMS:
        c.error(
            c.key_locs["head_dim"],
            f"head_dim {head_dim} is not supported on sm_90a; expected 64, 128 or 256 "
            "(whole 64-column panels of the 128-byte swizzle)",
        )
        ok = False
    groups = v["warpgroups"]
    consumers = groups["consumers"]
    if groups["producer"] != 1:
        c.error(
            c.key_locs["warpgroups.producer"],
            f"producer = {groups['producer']}: one producer warpgroup issues every TMA load",
        )
        ok = False
    if not 1 <= consumers <= MAX_CONSUMERS:
        c.error(
            c.key_locs["warpgroups.consumers"],
            f"consumers = {consumers} is out of range (1 to {MAX_CONSUMERS} consumer warpgroups)",
        )
        return False
    if block_r != ROWS_PER_CONSUMER * consumers:
        c.error(
            c.key_locs["B_r"],
            f"B_r = {block_r} must be 64 x consumers = {ROWS_PER_CONSUMER * consumers}: each "
            "consumer warpgroup owns 64 query rows (wgmma's M)",
        )
        ok = False
    if block_c > 256:
        c.error(c.key_locs["B_c"], f"B_c = {block_c} is over 256 (wgmma's N and TMA's box)")
        ok = False
    stages = v.get("stages", 2)
    q_slots = v.get("q_slots", 1)
    fp8 = eight_bit(c)
    need = smem_bytes(block_r, block_c, head_dim, stages, q_slots, fp8)
    ctas = v.get("ctas_per_sm", 1)
    if ok and ctas > 1 and smem_limit(ctas) < need <= CAPABILITIES.smem_per_cta:
        # one CTA would fit: it is the second that does not (plan_smem checks the placed plan)
        c.error(
            c.key_locs["ctas_per_sm_value"],
            f"ctas_per_sm {ctas}: the SMEM plan needs at least {need} bytes a CTA, over the "
            f"{smem_limit(ctas)} each of {ctas} CTAs may have ({CAPABILITIES.smem_per_sm} an "
            f"SM, {SMEM_RESERVED_PER_CTA} of it reserved a CTA); use ctas_per_sm 1, fewer "
            "stages or a smaller B_c",
        )
        ok = False
    if ok and need > CAPABILITIES.smem_per_cta:
        q_text = (
            f"Q {block_r}x{head_dim}" if q_slots == 1 else f"Q {q_slots} x {block_r}x{head_dim}"
        )
        rings = "K, V and transposed V rings" if fp8 else "K and V rings"
        if (
            q_slots > 1
            and smem_bytes(block_r, block_c, head_dim, stages, fp8=fp8) <= CAPABILITIES.smem_per_cta
        ):
            where, advice = c.key_locs["q_slots_value"], "use q_slots 1"
        else:
            where = c.key_locs.get("stages_value", c.key_locs["B_c"])
            advice = "use fewer stages or a smaller B_c"
        c.error(
            where,
            f"the SMEM plan needs {need} bytes ({q_text}, {rings} of "
            f"{stages} x {block_c}x{head_dim}, {'e4m3/e5m2' if fp8 else 'bf16/fp16'}, "
            "mbarriers, alignment), over "
            f"sm_90a's {CAPABILITIES.smem_per_cta}; {advice}",
        )
        ok = False
    ok = _registers(c, consumers, head_dim, block_c) and ok
    ok = _knobs(c, consumers) and ok
    ok = (validate_fp8(c) if fp8 else _output_of_16_bits(c)) and ok
    swizzle = v.get("swizzle", "128B")
    if swizzle != "128B":
        c.error(
            c.key_locs.get("swizzle_value", c.key_locs["swizzle"]),
            "sm_90a's tiles use the 128-byte swizzle that TMA writes and wgmma reads: "
            "'swizzle 128B'",
        )
        ok = False
    for loop in c.decl.mainloops:
        c.error(
            loop.loc,
            "sm_90a's mainloop is set by its schedule knobs ('pingpong on|off', "
            "'overlap on|off'), not by a mainloop block",
        )
        ok = False
    ok = _scopes(c, tensors) and ok
    ok = _serving(c, block_c) and ok
    ok = validate_modifiers(c) and ok
    return ok


def _serving(c: Checks, block_c: int) -> bool:
    """kv_cache, pack_gqa and splits: what each needs of the others (fadsl/sm90_kvcache.cuh)."""
    v, ok = c.values, True
    cache = v.get("kv_cache")
    if cache is not None:
        where = c.key_locs["kv_cache_value"]
        if v.get("varlen"):
            c.error(where, "kv_cache and varlen on do not combine yet: a cache has per-batch "
                    "lengths (cache_seqlens) of its own")  # fmt: skip
            ok = False
        if v.get("tail", False):
            c.error(c.key_locs["tail_value"], "with kv_cache, split the K/V blocks with "
                    "'splits auto' rather than 'tail split_kv'")  # fmt: skip
            ok = False
        if cache and cache % block_c and block_c % cache:
            c.error(where, f"paged({cache}) with B_c = {block_c}: a block must be whole pages "
                    "or a page whole blocks (one TMA box each)")  # fmt: skip
            ok = False
    for key, what in (("pack_gqa", "pack_gqa on"), ("splits", "splits auto")):
        # (a kv_cache line whose value was refused has said so already)
        if v.get(key) and cache is None and "kv_cache" not in c.key_locs:
            c.error(c.key_locs[f"{key}_value"], f"'{what}' is for kv_cache kernels: add "
                    "'kv_cache contiguous' or 'kv_cache paged(N)'")  # fmt: skip
            ok = False
    if v.get("pack_gqa") and "window" in v:
        c.error(c.key_locs["pack_gqa_value"], "pack_gqa on with a sliding window is not built yet")
        ok = False
    if v.get("splits") and "window" in v:
        c.error(c.key_locs["splits_value"], "splits auto splits a tile's blocks from block 0; a "
                "sliding window's start further on: use 'splits off' with a window")  # fmt: skip
        ok = False
    if v.get("splits") and not v.get("scheduler", True):
        c.error(c.key_locs["splits_value"], "splits auto deals pieces out to persistent CTAs: "
                "it needs 'scheduler persistent'")  # fmt: skip
        ok = False
    return ok


def _scopes(c: Checks, tensors: dict[Role, Tensor]) -> bool:
    """Q and O per warpgroup; K and V per CTA, or per cluster with `cluster 2`."""
    ok = True
    cluster = c.values.get("cluster", 1)
    for role, scope in SCOPES.items():
        tensor = tensors.get(role)
        if tensor is None or tensor.smem_scope is scope:
            continue
        if scope is Scope.CTA and tensor.smem_scope is Scope.CLUSTER:
            bad_value = "cluster" in c.key_locs and "cluster" not in c.values  # said already
            if cluster == 1 and not bad_value:
                c.error(
                    c.scope_loc(role),
                    f"{role.value} in smem[cluster] needs 'cluster 2': the cluster's CTAs "
                    "share the tile, each loading half of it into both",
                )
                ok = False
            continue
        if scope is Scope.WARPGROUP:
            why = "each consumer warpgroup owns its 64 rows"
        else:
            why = "every consumer warpgroup reads the whole tile"
        c.error(c.scope_loc(role), f"{role.value} lives in smem[{scope.value}]: {why}")
        ok = False
    if not ok or cluster == 1:
        return ok
    where = c.key_locs["cluster_value"]
    for role in (Role.K, Role.V):
        tensor = tensors.get(role)
        if tensor is not None and tensor.smem_scope is not Scope.CLUSTER:
            c.error(
                c.scope_loc(role),
                f"with 'cluster {cluster}', {role.value} lives in smem[cluster]: the CTAs of a "
                "cluster share every K and V block, each loading half of it into both",
            )
            return False
    if "window" in c.values:
        c.error(
            where,
            "cluster 2 pairs CTAs that read the same K/V blocks; a sliding window's "
            "neighbouring query blocks read different ones: use 'cluster 1' with a window",
        )
        return False
    if c.values.get("mask", Mask.NONE) is not Mask.NONE:
        c.error(
            where,
            "cluster 2 pairs CTAs that read the same K/V blocks; causal tiles of one head "
            "read different numbers of blocks: use 'cluster 1' with 'mask causal'",
        )
        return False
    if c.values.get("kv_cache") is not None:
        c.error(
            where,
            "cluster 2 pairs CTAs that read the same K/V blocks; a cache's sequences have "
            "lengths of their own: use 'cluster 1' with kv_cache",
        )
        return False
    if c.values.get("varlen"):
        c.error(
            where,
            "cluster 2 pairs CTAs on q blocks of one sequence with the same K/V blocks; "
            "varlen's tiles are dealt out longest first across sequences: use 'cluster 1' "
            "with 'varlen on'",
        )
        return False
    if c.values.get("tail", False):
        c.error(
            where,
            "cluster 2 and tail split_kv do not combine: the pieces of a split tile read "
            "different K/V blocks from their cluster peer's",
        )
        return False
    if c.values["head_dim"] < 2 * PANEL_COLUMNS:
        c.error(
            where,
            f"cluster 2 splits each K/V block into its 64-column panels, half for each CTA: "
            f"head_dim {c.values['head_dim']} has one panel; use head_dim 128 or 256",
        )
        return False
    return True


def _registers(c: Checks, consumers: int, head_dim: int, block_c: int) -> bool:
    regs = c.values.get("registers") or dict(
        zip(("producer", "consumers"), default_registers(consumers, c.values.get("ctas_per_sm", 1)))
    )
    lo, hi = SETMAXNREG_RANGE
    ok = True
    for role in ("producer", "consumers"):
        n = regs[role]
        if n % 8 or not lo <= n <= hi:
            c.error(
                c.key_locs.get(f"registers.{role}", c.decl.loc),
                f"setmaxnreg takes a multiple of 8 in [{lo}, {hi}], not {n}",
            )
            ok = False
    if not ok:
        return False
    total = registers_asked(regs["producer"], consumers, regs["consumers"])
    threads = WARPGROUP_THREADS * (1 + consumers)
    ctas = c.values.get("ctas_per_sm", 1)
    pool = register_pool(threads, ctas)
    if total > pool:
        room = (pool - registers_asked(regs["producer"], 0, 0)) // (WARPGROUP_THREADS * consumers)
        room -= room % REGISTER_UNIT
        fits = (
            f"with producer = {regs['producer']}, consumers = {room} fits"
            if room >= lo
            else "lower the producer's count"
        )
        c.error(
            c.key_locs.get("registers.consumers", c.decl.loc),
            f"128 x {regs['producer']} + 128 x {consumers} x {regs['consumers']} = {total} "
            f"registers, over the CTA's pool of {pool} ({threads} threads launch with "
            f"{launch_registers(threads, ctas)} each"
            + (f" at ctas_per_sm {ctas}" if ctas > 1 else "")
            + f"; setmaxnreg only moves registers within it, and setmaxnreg.inc would wait "
            f"forever); {fits}",
        )
        return False
    launch = launch_registers(threads, ctas)
    if regs["producer"] > launch:
        c.error(
            c.key_locs.get("registers.producer", c.decl.loc),
            f"producer = {regs['producer']}: setmaxnreg.dec only lowers a thread's count, and "
            f"{threads} threads launch with {launch} each"
            + (f" at ctas_per_sm {ctas}" if ctas > 1 else "")
            + f"; use producer = {launch} or fewer",
        )
        return False
    overlap = c.values.get("overlap", True)
    parts = consumer_registers(head_dim, block_c, overlap, eight_bit(c))
    need = sum(n for _, n in parts)
    if need > regs["consumers"]:
        listed = and_list(f"{what} ({n})" for what, n in parts)
        c.error(
            c.key_locs.get("registers.consumers", c.key_locs["B_c"]),
            f"a consumer thread needs about {need} registers (head_dim {head_dim}, "
            f"B_c = {block_c}: {listed}), over its setmaxnreg budget of {regs['consumers']}; "
            "use a smaller B_c, overlap off, or fewer consumer warpgroups with more registers",
        )
        return False
    return True


def _output_of_16_bits(c: Checks) -> bool:
    """`output` with 16-bit dtypes: refused, O has the inputs' type."""
    if "output" not in c.values:
        return True
    c.error(
        c.key_locs["output_value"],
        "a 16-bit kernel writes O in its own type: 'output' is for 8-bit dtypes (e4m3, e5m2)",
    )
    return False


def _knobs(c: Checks, consumers: int) -> bool:
    if c.values.get("pingpong", consumers > 1) and consumers < 2:
        c.error(
            c.key_locs.get("pingpong", c.decl.loc),
            "pingpong hands the tensor cores between consumer warpgroups: it needs "
            "consumers >= 2 (or 'pingpong off')",
        )
        return False
    if c.values.get("tail", False):
        where = c.key_locs["tail_value"]
        if not c.values.get("scheduler", True):
            c.error(
                where,
                "tail split_kv splits the persistent launch's last round of tiles over the "
                "idle CTAs: it needs 'scheduler persistent'",
            )
            return False
        if c.values.get("varlen"):
            c.error(
                where,
                "tail split_kv splits the last round of a launch of equal tiles; varlen's "
                "tiles run longest first, so the last round is already the shortest: use "
                "'tail whole' with 'varlen on'",
            )
            return False
        if "window" in c.values:
            c.error(
                where,
                "tail split_kv splits tiles that run the whole K/V sequence ('mask none'); a "
                "sliding window's tiles run a few blocks each, masked at both ends: use "
                "'tail whole' with a window",
            )
            return False
        if c.values.get("mask", Mask.NONE) is not Mask.NONE:
            c.error(
                where,
                "tail split_kv is for tiles of equal length ('mask none'); causal tiles are "
                "already dealt out in pairs of equal work",
            )
            return False
    return True


def configure(c: Checks) -> Config:
    v = c.values
    consumers = v["warpgroups"]["consumers"]
    split = default_registers(consumers, v.get("ctas_per_sm", 1))
    regs = v.get("registers") or dict(zip(("producer", "consumers"), split))
    return Config(
        name=c.decl.name.text,
        target=v["target"],
        dtypes=v["dtype"],
        head_dim=v["head_dim"],
        block_r=v["tile"]["B_r"],
        block_c=v["tile"]["B_c"],
        warps=4 * (1 + consumers),
        mask=v.get("mask", Mask.NONE),
        window=v.get("window"),
        swizzle=None,
        smem_alias=AliasPolicy.SCOPED,
        loc=c.decl.loc,
        key_locs=tuple(sorted(c.key_locs.items())),
        allow_spills=v.get("spills", False),
        ext=Sm90Config(
            consumers=consumers,
            stages=v.get("stages", 2),
            producer_regs=regs["producer"],
            consumer_regs=regs["consumers"],
            swizzle_bytes=128,
            pingpong=v.get("pingpong", consumers > 1),
            overlap=v.get("overlap", True),
            persistent=v.get("scheduler", True),
            rescale_mode=v.get("rescale", Rescale.LAZY),
            q_slots=v.get("q_slots", 1),
            split_kv=v.get("tail", False) or v.get("splits", False),
            cluster=v.get("cluster", 1),
            softcap=v.get("softcap", 0),
            varlen=v.get("varlen", False),
            kv_cache=v.get("kv_cache", -1),
            pack_gqa=v.get("pack_gqa", False),
            split_all=v.get("splits", False),
            ctas_per_sm=v.get("ctas_per_sm", 1),
        ),
        out_dtype=out_dtype(c),
    )


def validate_path(c: Checks, role: Role, path: PathDecl, levels: list[Level], hops: list) -> bool:
    transpose = next((hop for hop in hops if hop.instr is Instr.TRANSPOSE), None)
    if transpose is not None:
        return validate_transpose(c, role, path, levels, transpose)
    if role is Role.O:
        want = [Level.RF, Level.SMEM, Level.GMEM]
        text = "O must go rf -stmatrix-> smem[warpgroup] -tma-> gmem"
    else:
        want = [Level.GMEM, Level.SMEM, Level.RF]
        text = (
            f"{role.value} must go gmem -tma-> smem[...] -wgmma-> rf "
            "(wgmma reads the SMEM tile through a descriptor)"
        )
    if levels != want:
        c.error(path.tensor.loc, text)
        return False
    assert all(h.instr in (Instr.TMA, Instr.WGMMA, Instr.STMATRIX) for h in hops)
    return role is not Role.V or untransposed_v(c, path)
