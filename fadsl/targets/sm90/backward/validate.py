"""sm_90a's checks of a spec's backward block (``Target.validate_backward``), with located
errors that say what is allowed, and the block's defaults.

What the first backward kernel supports (docs/backward.md, FlashAttention-3's backward):
- the kernel's head_dim 64, 128 or 256, dtypes bf16/fp16, mask none or causal;
- B_r = 64 (queries per m-block), or at head_dim 64 B_r = 128 (dQ split by queries, 64 per
  consumer warpgroup: FlashAttention-3's 128 x 128 tile), B_c = 64 x consumers (keys per
  CTA: each consumer warpgroup owns 64 of them, wgmma's M for S^T and dP^T), one producer
  and 2 consumer warpgroups, Q and dO rings of 2 or 3 stages;
- `early_dv on` with `overlap on` only (it reorders the overlapped consumer), and
  `dv_before_meeting on` likewise, not with `early_dv on` (each says where dV is issued);
- `longest_first on` with the causal mask only (without it every CTA does the same work);
- `varlen on` (packed sequences) without `deterministic on` (a malformed cu_seqlens could
  give two sequences one dQ chunk, whose ordered adds would wait on each other) and without
  `longest_first on` (the varlen grid is a slot per n-block of the packed keys);
- dQ staged (its default path) or `rf -red.add-> gmem`, not with `deterministic on`;
- dS stored by st.shared (its default path) or `rf -stmatrix-> smem[cta]` (the same bytes,
  four 8 x 8 blocks an instruction); at B_r 80 by stmatrix .trans only (routes.py);
- `dq_writer on` (a writer warp per consumer reduce-adds its staging) with dQ staged and the
  consumers' shares of it disjoint (not split by keys: head_dim 64 at B_r 64), in either
  mode;
- `dq_lag on` (dQ one m-block behind: the consumers never meet) with `overlap on` and dQ by
  red.add or handed to the writer warps (`dq_writer on`, then in either mode), not with
  `deterministic` without the writer, `early_dv`, `dv_before_meeting`, head_dim 256, dQ
  split by keys or score and keep modifiers; `dq_first on` (that dQ issued before dV) with
  it only;
- `fused_convert on` (dQ converted by the main kernel's CTA that completes each m-block) with
  dQ by red.add only, not with `deterministic on` or a keep modifier;
- `scheduler persistent` (a CTA per SM looping over the tiles) not with `deterministic on`,
  `dq_writer on`, `varlen on`, head_dim 256 or score and keep modifiers (the first version's
  loop carries no state of theirs across tiles);
- setmaxnreg: the producer 24 to 56, the consumers at most 240, multiples of 8, their total
  within the CTA's launch allocation (as the forward's: setmaxnreg only moves registers
  within it);
- each tensor's path (``PATHS`` or ``OTHER_PATHS``): hops, instructions and sharing scope;
- the SMEM plan (``plan_smem.plan_smem``) within sm_90a's 227 KB per CTA;
- at head_dim 256 (sm90_bwd_split.cuh: the consumers split head_dim; FlashAttention-3's
  64 x 80 tile): B_r 64, B_c 80 or 64, P and dS through SMEM by stmatrix, dQ added from
  registers (its staging does not fit), no `deterministic on` (which needs the staging, as
  FlashAttention-3 has none at 256), `overlap`, `early_dv` and `dv_before_meeting` off (that
  consumer's order is its own).
Every key has a default, so `backward {}` alone is a valid block.
"""

from __future__ import annotations

from ....spec.checks import BackwardBlock, Checks, and_list
from ....ir import Backward, BackwardTensor, Dtype, GradRole, Hop, Mask, Role
from ....spec.syntax import PathDecl
from ..caps import (
    CAPABILITIES,
    REGISTER_UNIT,
    ROWS_PER_CONSUMER,
    WARPGROUP_THREADS,
    launch_registers,
    register_pool,
    registers_asked,
)
from .knobs import check_knobs
from .plan_smem import SPLIT_HEAD_DIM, plan_smem
from .routes import (  # (the path tables: tune_space, variants and tests read them here)
    DK_TMA,
    DQ_RED,
    DS_STMATRIX,
    DV_TMA,
    DS_TRANSPOSED,
    OTHER_PATHS,
    PATHS,
    SPLIT_PATHS,
    TRANSPOSED_BLOCK_M,
    Route,
    other_path,
    paths_of,
)

HEAD_DIMS = (64, 128, SPLIT_HEAD_DIM)
DTYPES = (Dtype.BF16, Dtype.FP16)  # every dtype today; a new one needs its backward first
MASKS = (Mask.NONE, Mask.CAUSAL)
BLOCK_M = 64  # queries per m-block: wgmma's M of the dQ GEMM
# B_r = 64 per consumer warpgroup: each computes dQ for its 64 queries; S^T and dP^T of 64
# keys x 128 queries take 64 + 64 fp32 registers, so only beside head_dim 64's dK and dV
WIDE_BLOCK_M = 128
WIDE_HEAD_DIMS = (64,)
# B_r = 80 (routes.py's TRANSPOSED_BLOCK_M) at head_dim 128: dQ^T = K^T dS^T
TRANSPOSED_HEAD_DIMS = (128,)
# head_dim 256: each consumer computes S and dP for B_c / 2 keys (a multiple of 8: wgmma's N)
# and holds dK^T and dV^T of all B_c keys for its 128 columns, 2 x B_c / 2 x 2 registers a
# thread: B_c 80 (FlashAttention-3's; 160 accumulator registers) or 64 (128) fit in 240
SPLIT_BLOCK_NS = (80, 64)
CONSUMERS = 2
STAGES = (2, 3)
PRODUCER_REGS = (24, 56)  # the producer only issues loads
CONSUMER_REGS = (24, 240)
SMEM_LIMIT = CAPABILITIES.smem_per_cta

# The block's defaults: FlashAttention-3's backward at head_dim 128 (at 256: its 64 x 80).
DEFAULT_TILE = {"B_r": BLOCK_M, "B_c": ROWS_PER_CONSUMER * CONSUMERS}
SPLIT_DEFAULT_TILE = {"B_r": BLOCK_M, "B_c": SPLIT_BLOCK_NS[0]}
DEFAULT_WARPGROUPS = {"producer": 1, "consumers": CONSUMERS}
DEFAULT_REGISTERS = {"producer": 24, "consumers": 240}
DEFAULT_STAGES = 2

P_IN_REGISTERS = (
    f"P stays in registers below head_dim {SPLIT_HEAD_DIM} (dV += P^T dO takes it as the "
    "wgmma's A operand): leave its path out"
)


def default_tile(head_dim: int | None) -> dict[str, int]:
    """The `tile` of a block that leaves it out."""
    return SPLIT_DEFAULT_TILE if head_dim == SPLIT_HEAD_DIM else DEFAULT_TILE


def validate_backward(c: Checks, block: BackwardBlock) -> Backward | None:
    """The block checked against the kernel it belongs to, every default filled in; None
    when something was reported."""
    head_dim = c.values.get("head_dim")
    if any(d.is_8bit for d in c.values.get("dtype", ())):
        block.checks.error(
            block.loc,
            "8-bit dtypes have no backward pass (the FP8 kernel is a forward, "
            "research/fp8-forward.md): remove the backward block; the kernel is then "
            "forward-only",
        )
        return None
    ok = _kernel_settings(c)
    ok = _shape(block, head_dim) and ok
    if block.values.get("longest_first") and c.values.get("mask", Mask.NONE) is not Mask.CAUSAL:
        block.checks.error(
            block.key_locs["longest_first"],
            "longest_first on orders CTAs by their work, which differs only under the causal "
            "mask (n-block 0 sees every m-block, the last one the fewest); without it every "
            "CTA does the same: leave it off",
        )
        ok = False
    if c.values.get("varlen"):
        for key, why in (
            (
                "deterministic",
                "its ordered dQ adds need each m-block's chunk to be one sequence's, which a "
                "malformed cu_seqlens (read on the GPU only) could break, and then a CTA "
                "would wait forever",
            ),
            ("longest_first", "the varlen grid runs a slot per n-block of the packed keys"),
        ):
            if block.values.get(key):
                block.checks.error(
                    block.key_locs[key],
                    f"{key} on is for padded batches: with varlen on {why}; leave it off",
                )
                ok = False
    regs_ok = _registers(block)
    ok = regs_ok and ok
    tile = block.values.get("tile", default_tile(head_dim))
    paths = paths_of(tile["B_r"], head_dim)
    for role, (tensor, decl) in block.paths.items():
        if role not in paths:  # (P below head_dim 256)
            block.checks.error(decl.tensor.loc, P_IN_REGISTERS)
            ok = False
            continue
        other = other_path(role, tile["B_r"], head_dim)
        ok = _path(block.checks, paths[role], other, tensor, decl) and ok
    tensors = tuple(_tensor(block, role, route) for role, route in paths.items())
    groups = block.values.get("warpgroups", DEFAULT_WARPGROUPS)
    regs = block.values.get("registers", DEFAULT_REGISTERS)
    backward = Backward(
        block_m=tile["B_r"],
        block_n=tile["B_c"],
        consumers=groups["consumers"],
        producer_regs=regs["producer"],
        consumer_regs=regs["consumers"],
        stages=block.values.get("stages", DEFAULT_STAGES),
        deterministic=block.values.get("deterministic", False),
        overlap=block.values.get("overlap", False),
        early_dv=block.values.get("early_dv", False),
        dv_before_meeting=block.values.get("dv_before_meeting", False),
        dq_lag=block.values.get("dq_lag", False),
        dq_first=block.values.get("dq_first", False),
        longest_first=block.values.get("longest_first", False),
        dq_writer=block.values.get("dq_writer", False),
        dq_chains=block.values.get("dq_chains", 1),
        persistent=block.values.get("scheduler", False),
        fused_convert=block.values.get("fused_convert", False),
        prefetch_kv=block.values.get("prefetch_kv", False),
        dv_out_first=block.values.get("dv_out_first", False),
        peel_dead=block.values.get("peel_dead", False),
        late_v=block.values.get("late_v", False),
        dq_red=_takes(tensors, GradRole.DQ, DQ_RED),
        ds_stmatrix=other_path(GradRole.DS, tile["B_r"], head_dim) is not None
        and _takes(tensors, GradRole.DS, DS_STMATRIX),
        dkv_tma=other_path(GradRole.DK, tile["B_r"], head_dim) is not None
        and _takes(tensors, GradRole.DK, DK_TMA),
        loc=block.loc,
        tensors=tensors,
        key_locs=tuple(sorted(block.key_locs.items())),
    )
    ok = _same_dkv_paths(block, tensors, tile["B_r"], head_dim) and ok
    ok = check_knobs(c, block, backward, head_dim) and ok
    if ok and head_dim in HEAD_DIMS:
        ok = _smem(block, backward, head_dim)
    return backward if ok else None


def _kernel_settings(c: Checks) -> bool:
    """The kernel's own settings that its backward depends on."""
    ok = True
    head_dim = c.values.get("head_dim")
    if head_dim is not None and head_dim not in HEAD_DIMS:
        c.error(
            c.key_locs["head_dim"],
            f"the backward block needs head_dim 64, 128 or 256 (what its kernel is built for), "
            f"not {head_dim}; without the block the kernel is forward-only",
        )
        ok = False
    for dtype in c.values.get("dtype", ()):
        if dtype not in DTYPES:
            c.error(
                c.key_locs["dtype"],
                f"the backward block needs dtypes {and_list([d.value for d in DTYPES])}, "
                f"not {dtype.value}",
            )
            ok = False
    mask = c.values.get("mask", Mask.NONE)
    if mask not in MASKS:
        c.error(
            c.key_locs["mask"],
            f"the backward block needs mask {' or '.join(m.value for m in MASKS)}, "
            f"not {mask.value}",
        )
        ok = False
    for key in ("kv_cache", "pack_gqa", "splits"):
        value = c.values.get(key)
        if value is not None and value is not False:  # (kv_cache contiguous is 0)
            c.error(
                c.key_locs[f"{key}_value"],
                f"'{key}' is for serving; a kernel with a backward block trains: leave one out",
            )
            ok = False
    return ok


def _shape(block: BackwardBlock, head_dim: int | None) -> bool:
    """Tiles, warpgroups, stages and the consumer's order as the backward kernel has them."""
    c, v, where = block.checks, block.values, block.key_locs
    ok = True
    groups = v.get("warpgroups", DEFAULT_WARPGROUPS)
    if groups["producer"] != 1:
        c.error(
            where["warpgroups.producer"],
            f"producer = {groups['producer']}: one producer warpgroup issues every load of "
            "the backward (producer = 1)",
        )
        ok = False
    consumers = groups["consumers"]
    if consumers != CONSUMERS:
        c.error(
            where["warpgroups.consumers"],
            f"consumers = {consumers}: the backward kernel has {CONSUMERS} consumer "
            f"warpgroups (consumers = {CONSUMERS})",
        )
        ok = False
    stages = v.get("stages", DEFAULT_STAGES)
    if stages not in STAGES:
        c.error(
            where["stages_value"],
            f"stages {stages}: the backward's Q and dO rings take "
            f"{' or '.join(map(str, STAGES))} slots",
        )
        ok = False
    tile = v.get("tile", default_tile(head_dim))
    if head_dim == SPLIT_HEAD_DIM:
        return _split_shape(block, tile) and ok
    if tile["B_r"] == WIDE_BLOCK_M and head_dim is not None and head_dim not in WIDE_HEAD_DIMS:
        c.error(
            where["B_r"],
            f"B_r = {WIDE_BLOCK_M} needs head_dim 64: S^T and dP^T of {WIDE_BLOCK_M} queries "
            f"beside dK and dV of head_dim {head_dim} take more than a consumer's 240 "
            f"registers (B_r = {BLOCK_M})",
        )
        ok = False
    elif (
        tile["B_r"] == TRANSPOSED_BLOCK_M
        and head_dim is not None
        and head_dim not in TRANSPOSED_HEAD_DIMS
    ):
        c.error(
            where["B_r"],
            f"B_r = {TRANSPOSED_BLOCK_M} needs head_dim 128: its dQ^T = K^T dS^T gives each "
            f"of the 2 consumer warpgroups one 64-column panel of head_dim (B_r = {BLOCK_M})",
        )
        ok = False
    elif tile["B_r"] not in (BLOCK_M, WIDE_BLOCK_M, TRANSPOSED_BLOCK_M):
        c.error(
            where["B_r"],
            f"B_r = {tile['B_r']}: the backward steps through the queries {BLOCK_M} at a time "
            f"(one wgmma M), at head_dim 64 {WIDE_BLOCK_M} at a time ({BLOCK_M} per "
            f"consumer warpgroup), or at head_dim 128 {TRANSPOSED_BLOCK_M} at a time (dQ "
            f"transposed) (B_r = {BLOCK_M}, {WIDE_BLOCK_M} or {TRANSPOSED_BLOCK_M})",
        )
        ok = False
    for order in ("early_dv", "dv_before_meeting"):
        if v.get(order) and not v.get("overlap"):
            c.error(
                where[order],
                f"{order} on reorders the overlapped consumer: it needs 'overlap on' in the "
                "backward block",
            )
            ok = False
    if v.get("dv_before_meeting") and v.get("early_dv"):
        c.error(
            where["dv_before_meeting"],
            "dv_before_meeting on and early_dv on each say where dV is issued (before the "
            "meeting at dS^T, or before dS): choose one",
        )
        ok = False
    keys = ROWS_PER_CONSUMER * consumers
    if consumers == CONSUMERS and tile["B_c"] != keys:
        c.error(
            where["B_c"],
            f"B_c = {tile['B_c']}: the backward's B_c is 64 x consumers = {keys}, each "
            "consumer warpgroup owning 64 keys (wgmma's M for S^T and dP^T)",
        )
        ok = False
    return ok


def _split_shape(block: BackwardBlock, tile: dict[str, int]) -> bool:
    """The tile and the consumer's order at head_dim 256 (sm90_bwd_split.cuh)."""
    c, v, where = block.checks, block.values, block.key_locs
    ok = True
    if tile["B_r"] != BLOCK_M:
        c.error(
            where["B_r"],
            f"B_r = {tile['B_r']}: at head_dim {SPLIT_HEAD_DIM} the backward steps through the "
            f"queries {BLOCK_M} at a time, wgmma's M of S and dP (B_r = {BLOCK_M})",
        )
        ok = False
    if tile["B_c"] not in SPLIT_BLOCK_NS:
        c.error(
            where["B_c"],
            f"B_c = {tile['B_c']}: at head_dim {SPLIT_HEAD_DIM} each of the {CONSUMERS} consumer "
            "warpgroups computes S and dP for B_c / 2 keys and holds dK^T and dV^T of all B_c "
            "keys for its 128 columns (2 B_c fp32 registers a thread): B_c = "
            f"{' or '.join(map(str, SPLIT_BLOCK_NS))} fit in 240 registers",
        )
        ok = False
    refused = {
        "deterministic": (
            "its ordered dQ adds go through a staging buffer in SMEM, and at head_dim "
            f"{SPLIT_HEAD_DIM} dQ's staging does not fit beside K, V, Q, dO, P and dS "
            "(FlashAttention-3 has no deterministic mode there either)"
        ),
        "overlap": (
            "that consumer's order issues dQ before dV and dK; at head_dim "
            f"{SPLIT_HEAD_DIM} dQ^T is computed a panel at a time, each panel's adds under a "
            "dK^T panel, an order of its own"
        ),
        "early_dv": (
            f"at head_dim {SPLIT_HEAD_DIM} dV^T is the first wgmma issued after P and dS are "
            "in SMEM already"
        ),
        "dq_writer": (
            f"at head_dim {SPLIT_HEAD_DIM} dQ is added from registers, with no staging for "
            "a writer warp to reduce-add"
        ),
        "dv_before_meeting": (
            f"at head_dim {SPLIT_HEAD_DIM} dV^T reads every key's P from SMEM, so it cannot be "
            "issued before the warpgroups meet; it is the first wgmma issued after the meeting "
            "already"
        ),
    }
    for key, why in refused.items():
        if v.get(key):
            c.error(where[key], f"{key} on: {why}; leave it off")
            ok = False
    return ok


def _registers(block: BackwardBlock) -> bool:
    c, where = block.checks, block.key_locs
    regs = block.values.get("registers", DEFAULT_REGISTERS)
    ok = True
    for role, who, (lo, hi) in (
        ("producer", "producer takes", PRODUCER_REGS),
        ("consumers", "consumers take", CONSUMER_REGS),
    ):
        n = regs[role]
        if n % REGISTER_UNIT or not lo <= n <= hi:
            c.error(
                where[f"registers.{role}"],
                f"the backward's {who} setmaxnreg {lo} to {hi}, a multiple of "
                f"{REGISTER_UNIT}, not {n}",
            )
            ok = False
    consumers = block.values.get("warpgroups", DEFAULT_WARPGROUPS)["consumers"]
    if not ok or consumers != CONSUMERS:
        return ok
    total = registers_asked(regs["producer"], consumers, regs["consumers"])
    threads = WARPGROUP_THREADS * (1 + consumers)
    pool = register_pool(threads)
    if total <= pool:
        return True
    room = (pool - registers_asked(regs["producer"], 0, 0)) // (WARPGROUP_THREADS * consumers)
    room = min(room - room % REGISTER_UNIT, CONSUMER_REGS[1])
    c.error(
        where.get("registers.consumers", block.loc),
        f"128 x {regs['producer']} + 128 x {consumers} x {regs['consumers']} = {total} "
        f"registers, over the CTA's pool of {pool} ({threads} threads launch with "
        f"{launch_registers(threads)} each; setmaxnreg only moves registers within it, and "
        f"setmaxnreg.inc would wait forever); with producer = {regs['producer']}, "
        f"consumers = {room} fits",
    )
    return False


def _same_dkv_paths(block: BackwardBlock, tensors, block_m: int, head_dim: int | None) -> bool:
    """dK and dV leave the CTA the same way (one epilogue stores both)."""
    if other_path(GradRole.DK, block_m, head_dim) is None:
        return True
    dk, dv = _takes(tensors, GradRole.DK, DK_TMA), _takes(tensors, GradRole.DV, DV_TMA)
    if dk == dv:
        return True
    role = GradRole.DV if dk else GradRole.DK
    where = block.paths[role][1].tensor.loc if role in block.paths else block.loc
    route = DV_TMA if dk else DK_TMA
    block.checks.error(
        where,
        f"{role.value} goes the way {(GradRole.DK if dk else GradRole.DV).value} goes in the "
        f"backward (one epilogue stores both): {route.text()}, or both from registers",
    )
    return False


def _takes(tensors: tuple[BackwardTensor, ...], role: Role | GradRole, route: Route) -> bool:
    """Whether ``role``'s path (the spec's, or its default) is ``route``."""
    tensor = next(t for t in tensors if t.role is role)
    return (
        tuple(hop.instr for hop in tensor.hops) == route.instrs
        and (tensor.hops[0].src, *(hop.dst for hop in tensor.hops)) == route.levels
    )


def _path(
    c: Checks, route: Route, other: Route | None, tensor: BackwardTensor, decl: PathDecl
) -> bool:
    role = tensor.role
    levels = (tensor.hops[0].src, *(hop.dst for hop in tensor.hops))
    instrs = tuple(hop.instr for hop in tensor.hops)
    # (dS's two stores share their levels: the instructions choose)
    same = other is not None and levels == other.levels
    matches = lambda r: sum(a is b for a, b in zip(instrs, r.instrs))  # noqa: E731
    if same and (levels != route.levels or matches(other) > matches(route)):
        route = other
    if levels != route.levels:
        also = f", or {other.text()} ({other.why})" if other is not None else ""
        c.error(
            decl.tensor.loc,
            f"{role.value} must go {route.text()} in the backward ({route.why}){also}",
        )
        return False
    ok = True
    if tensor.smem_scope is not route.scope:
        scope = next(ref.scope for ref in decl.levels if ref.scope is not None)
        c.error(
            scope.loc,
            f"{role.value} lives in smem[{route.scope.value}] in the backward: {route.why}",
        )
        ok = False
    routes = (route, other) if same and other is not route else (route,)
    for n, hop in enumerate(tensor.hops):
        if hop.instr is not route.instrs[n]:
            does = " or ".join(dict.fromkeys(f"'{r.instrs[n].value}'" for r in routes))
            c.error(
                hop.loc,
                f"'{hop.instr.value}' does not move {role.value} {hop.src.value} -> "
                f"{hop.dst.value} in the backward; {does} {'do' if ' or ' in does else 'does'} "
                f"({role.value}: {', or '.join(r.text() for r in routes)})",
            )
            ok = False
    return ok


def _tensor(block: BackwardBlock, role: Role | GradRole, route: Route) -> BackwardTensor:
    """The path the spec wrote for ``role``, else its default ``route``, located at the
    block."""
    if role in block.paths:
        return block.paths[role][0]
    hops = tuple(
        Hop(src, dst, instr, block.loc)
        for (src, dst), instr in zip(zip(route.levels, route.levels[1:]), route.instrs)
    )
    return BackwardTensor(role, hops, route.scope, block.loc)


def _smem(block: BackwardBlock, backward: Backward, head_dim: int) -> bool:
    plan = plan_smem(backward, head_dim)
    if plan.total <= SMEM_LIMIT:
        return True
    where = block.key_locs
    listed = ", ".join(f"{b.name} {b.nbytes}" for b in plan.buffers)
    block.checks.error(
        where.get("stages_value", where.get("B_c", block.loc)),
        f"the backward's SMEM plan needs {plan.total} bytes at head_dim {head_dim} ({listed}), "
        f"over sm_90a's {SMEM_LIMIT}; use fewer stages",
    )
    return False
