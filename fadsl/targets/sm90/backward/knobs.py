"""sm_90a's backward knobs that combine only in some ways (validate.py calls
``check_knobs`` once the block is read): each refusal located at the key that asks for what
is not built beside the rest, with what would work instead.

- dQ by red.add is not ordered: not with `deterministic on` (a writer warp may make the
  ordered adds of a staged dQ);
- `dq_writer on` needs dQ staged in shares of its own;
- `dq_chains N` splits the writer warps' ordered adds, so it needs both;
- `scheduler persistent` carries no per-CTA state but K, V and the dK, dV accumulators;
- `dq_lag on` reorders the overlapped consumer with dQ from registers; `dq_first on` orders
  that lag;
- `fused_convert on` counts each m-block's contributing n-blocks from the block's ranges;
- dK and dV stored by TMA from the dead K and V tiles: the lagged consumer's epilogue, one
  tile per CTA, padded batches;
- `prefetch_kv on` reads ahead in the grid's launch order, one tile per CTA;
- `dv_out_first on` moves dV's TMA store, so it needs dK and dV by TMA;
- `peel_dead on` peels the lagged consumer's first m-block, one tile per CTA, no window;
- `late_v on` loads V in the lagged consumer's first m-block, one tile per CTA.
"""

from __future__ import annotations

from ....ir import Backward, GradRole
from ....spec.checks import BackwardBlock, Checks, and_list
from ....spec.syntax import ExprLine
from .plan_smem import SPLIT_HEAD_DIM, dq_by_keys
from .routes import DK_TMA, DQ_RED, PATHS


def check_knobs(c: Checks, block: BackwardBlock, backward: Backward, head_dim: int | None) -> bool:
    """Whether the block's knobs combine; each refusal reported at its key."""
    ok = True
    if backward.dq_red and backward.deterministic and head_dim != SPLIT_HEAD_DIM:
        _, decl = block.paths[GradRole.DQ]
        block.checks.error(
            decl.tensor.loc,
            f"dQ's red.add adds in whatever order the threads get there: deterministic on "
            f"needs dQ staged for its ordered reduce-add ({PATHS[GradRole.DQ].text()}); "
            f"where dQ's shares are disjoint, `dq_writer on` beside it has writer warps make "
            f"those adds (0.90-0.96x the default's speed on an H200, docs/performance.md)",
        )
        ok = False
    if backward.dq_writer and head_dim in (64, 128):
        ok = _dq_writer(block, backward, head_dim) and ok
    if backward.dq_chains != 1:
        ok = _dq_chains(block, backward) and ok
    if backward.persistent:
        ok = _persistent(c, block, backward, head_dim) and ok
    if backward.dq_lag:
        ok = _dq_lag(c, block, backward, head_dim) and ok
    if backward.dq_first and not backward.dq_lag:
        block.checks.error(
            block.key_locs["dq_first"],
            "dq_first on orders the lagged dQ (dQ(i - 1) issued before dV(i)): it needs "
            "`dq_lag on`",
        )
        ok = False
    if backward.fused_convert:
        ok = _fused_convert(c, block, backward) and ok
    if backward.dkv_tma:
        ok = _dkv_tma(c, block, backward) and ok
    if backward.prefetch_kv:
        why = []
        if backward.persistent:
            why.append(
                "scheduler persistent (a CTA loads its next tile's K and V under this one's "
                "stores already)"
            )
        knob = "prefetch_kv on (the K and V of the CTA launched a wave later fetched into the L2)"
        ok = _refused(block, "prefetch_kv", knob, why, "leave it off") and ok
    if backward.dv_out_first and not backward.dkv_tma:
        why = [f"dV stored from registers (it moves dV's TMA store: dV: {DK_TMA.text()})"]
        knob = "dv_out_first on (dV staged and stored by TMA before the last m-block's dQ)"
        ok = _refused(block, "dv_out_first", knob, why, "leave it off") and ok
    if backward.peel_dead:
        ok = _peel_dead(c, block, backward) and ok
    if backward.late_v:
        ok = _late_v(block, backward) and ok
    return ok


def _late_v(block: BackwardBlock, backward: Backward) -> bool:
    """`late_v on`: V on a barrier of its own, loaded after the first m-block's ring slot; built
    in the lagged consumer (whose warpgroups wait for V before their first dP^T and once after
    the loop, where dV may be staged over V), with one tile per CTA (a persistent CTA's V
    would need its own empty barrier per tile)."""
    why = []
    if not backward.dq_lag:
        why.append("dq_lag off (the lagged consumer waits for the late V: 'dq_lag on')")
    if backward.persistent:
        why.append("scheduler persistent (V is loaded once for the CTA's one tile)")
    knob = "late_v on (V loaded after the first m-block's Q and dO, on a barrier of its own)"
    return _refused(block, "late_v", knob, why, "leave it off")


def _peel_dead(c: Checks, block: BackwardBlock, backward: Backward) -> bool:
    """`peel_dead on`: built in the lagged consumer (its dS^T hand-over by mbarriers lets one
    warpgroup skip an m-block's products), for a tile per CTA, where dS^T keeps the keys as
    rows and the keys the peel skips are those the causal edge or the keys' end masks, without
    a sliding window. Score and keep modifiers and learnable inputs take it: keep only narrows
    the mask the peel's test reads, and a masked score's P, dS and gradient adds are zeros."""
    why = []
    if not backward.dq_lag:
        why.append("dq_lag off (it peels the lagged consumer's first m-block: 'dq_lag on')")
    if backward.block_m % 64:
        why.append(
            f"B_r = {backward.block_m} (dQ transposed: dS^T's rows are queries, each warpgroup "
            "a 64-key panel)"
        )
    if backward.persistent:
        why.append("scheduler persistent (the peel is of a CTA's one tile)")
    if "window" in c.values:
        why.append("a sliding window (not yet timed or tested with it)")
    knob = "peel_dead on (a warpgroup whose keys are all masked skips its first m-block's products)"
    return _refused(block, "peel_dead", knob, why, "leave it off")


def _dkv_tma(c: Checks, block: BackwardBlock, backward: Backward) -> bool:
    """dK and dV through the dead K and V tiles by TMA: built in the lagged consumer, whose
    last dQ retires in every warpgroup before K is overwritten (the last dS^T buffer's empty
    barrier), with one tile per CTA (a persistent CTA's next K and V would wait for the
    store's read) and boxes that no packed sequence's end cuts."""
    why = []
    if not backward.dq_lag:
        why.append("dq_lag off (the lagged consumer's epilogue stores them: 'dq_lag on')")
    if backward.persistent:
        why.append("scheduler persistent (the next tile's K and V load into those tiles)")
    if c.values.get("varlen"):
        why.append("varlen on (a 64-row box would reach into the next sequence's keys)")
    if not why:
        return True
    role = GradRole.DK if GradRole.DK in block.paths else GradRole.DV
    block.checks.error(
        block.paths[role][1].tensor.loc,
        f"{role.value}'s path {DK_TMA.text()} is not built with {and_list(why)}: "
        f"store dK and dV from registers there ({PATHS[GradRole.DK].text()})",
    )
    return False


def _refused(block: BackwardBlock, key: str, knob: str, why: list[str], instead: str) -> bool:
    """Whether ``knob`` (set at ``key``) combines with the rest: refused, located, where
    ``why`` names what it is not built with."""
    if not why:
        return True
    block.checks.error(
        block.key_locs[key], f"{knob} is not built with " + and_list(why) + f": {instead}"
    )
    return False


def _persistent(c: Checks, block: BackwardBlock, backward: Backward, head_dim: int | None) -> bool:
    """`scheduler persistent`: the first version's CTA loops over tiles of padded batches
    with per-tile state only in K, V and the dK, dV accumulators; what keeps other state per
    CTA is refused here."""
    why = []
    if backward.deterministic:
        why.append("deterministic on (its dQ tickets assume a CTA per n-block, in launch order)")
    if backward.dq_writer:
        why.append("dq_writer on (the writer warps' barriers are per CTA, not per tile)")
    if c.values.get("varlen"):
        why.append("varlen on (its grid is a slot per n-block of the packed keys)")
    if head_dim == SPLIT_HEAD_DIM:
        why.append(f"head_dim {SPLIT_HEAD_DIM} (its consumers split head_dim: another loop)")
    if c.decl.modifiers:
        why.append("score or keep modifiers (their per-block state is not carried over tiles)")
    knob = "scheduler persistent (a CTA per SM looping over the tiles)"
    return _refused(block, "scheduler", knob, why, "use scheduler grid (the default) there")


def _dq_lag(c: Checks, block: BackwardBlock, backward: Backward, head_dim: int | None) -> bool:
    """`dq_lag on`: the overlapped consumer with dQ(i - 1) issued in m-block i
    (sm90_bwd_lag.cuh); what that order is not built with is refused here."""
    why = []
    if not backward.overlap:
        why.append("overlap off (it reorders the overlapped consumer: 'overlap on')")
    if not backward.dq_red and not backward.dq_writer:
        why.append(
            f"dQ staged and reduce-added by the consumers (it adds dQ from registers, "
            f"{DQ_RED.text()}, or hands the staging to the writer warps, dq_writer on)"
        )
    if backward.deterministic and not backward.dq_writer:
        why.append(
            "deterministic on without dq_writer on (the consumers' tickets assume dQ added in "
            "its own m-block; the writer warps' do not)"
        )
    for key in ("early_dv", "dv_before_meeting"):
        if getattr(backward, key):
            why.append(f"{key} on (dV is issued before dQ already: dV's place is fixed)")
    if head_dim == SPLIT_HEAD_DIM:
        why.append(f"head_dim {SPLIT_HEAD_DIM} (its consumers split head_dim: another loop)")
    elif head_dim is not None and dq_by_keys(backward, head_dim):
        why.append(
            f"dQ split by keys (head_dim {head_dim} at B_r = {backward.block_m}: each consumer's "
            "dQ reads only its own dS^T rows, so the consumers never meet there already)"
        )
    knob = "dq_lag on (dQ one m-block behind, so that the consumers never meet)"
    return _refused(block, "dq_lag", knob, why, "leave it off")


def _fused_convert(c: Checks, block: BackwardBlock, backward: Backward) -> bool:
    """`fused_convert on`: each (batch, head, m-block)'s counter completes when every n-block
    that visits it has counted itself done (sm90_bwd_convert.cuh); what would break that
    count, or the counter array it shares with the ordered adds, is refused here."""
    why = []
    if not backward.dq_red:
        why.append(f"dQ staged (the count follows adds from registers: {DQ_RED.text()})")
    if backward.deterministic:
        why.append("deterministic on (its tickets use the counters)")
    if any(isinstance(line, ExprLine) and line.keyword.text == "keep" for line in c.decl.modifiers):
        why.append("a keep modifier (its trimmed ranges are not in the count)")
    knob = "fused_convert on (dQ converted by the CTA that completes each m-block)"
    return _refused(block, "fused_convert", knob, why, "leave it off")


def _dq_chains(block: BackwardBlock, backward: Backward) -> bool:
    """`dq_chains N`: the writer warps' tickets of `deterministic on`, split into N chains
    (sm90_bwd_writer.cuh); built for the writer warps' adds only."""
    why = []
    if not backward.deterministic:
        why.append("deterministic off (the chains order dQ's adds: 'deterministic on')")
    if not backward.dq_writer:
        why.append("dq_writer off (the writer warps take each chain's ticket: 'dq_writer on')")
    knob = f"dq_chains {backward.dq_chains} (dQ's ordered adds in {backward.dq_chains} chains of tickets)"
    return _refused(block, "dq_chains", knob, why, "use dq_chains 1 (the default)")


def _dq_writer(block: BackwardBlock, backward: Backward, head_dim: int) -> bool:
    """`dq_writer on`: writer w reduce-adds consumer w's staged share, which must be its
    own (research/backward-dq-writer.md)."""
    where = block.key_locs["dq_writer"]
    if backward.dq_red:
        block.checks.error(
            where,
            "dq_writer on hands each consumer's staged dQ to a writer warp for its bulk "
            f"reduce-add; dQ's path here adds from registers: give dQ its staged path "
            f"({PATHS[GradRole.DQ].text()}) or leave dq_writer off",
        )
        return False
    if dq_by_keys(backward, head_dim):
        block.checks.error(
            where,
            f"dq_writer on: at head_dim {head_dim} with B_r = {backward.block_m} dQ is split by keys, "
            "so both consumer warpgroups add into all of the m-block's dQ, and their adds "
            "keep the consumers' own order; a writer needs a share of its own (B_r = "
            "128 at head_dim 64 splits dQ by queries): leave it off",
        )
        return False
    return True
