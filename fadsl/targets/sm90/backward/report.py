"""What `fadsl explain` says about a kernel's backward block on sm_90a: its settings and
paths, the roles of the main kernel's warpgroups, the setmaxnreg split and the SMEM map of
``plan_smem.plan_smem`` (docs/backward.md). The syncs section is left for the backward's sync
pass (``backward_syncs``)."""

from __future__ import annotations

from typing import Any, Mapping

from ....ir import Kernel
from ..caps import (
    CAPABILITIES,
    REGISTERS_PER_SM,
    WARPGROUP_THREADS,
    launch_registers,
    register_pool,
    registers_asked,
)
from .emit import FUSED_CONVERT_MAX_QUERIES
from .plan_smem import (
    do_stages,
    dq_by_keys,
    dq_by_queries,
    dq_transposed,
    plan_smem,
    split_head_dim,
)
from .protocol import Guard, Index, Item, Kind, Params
from .protocol import WarpRole
from .protocol import protocol


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _warpgroups(first: int, count: int) -> str:
    return f"warpgroup {first}" if count == 1 else f"warpgroups {first}..{first + count - 1}"


# --- the syncs: a place for the backward's sync pass ---------------------------------


def backward_syncs(kernel: Kernel) -> list[dict[str, Any]]:
    """The main kernel's syncs, role by role in program order, as the sync pass placed them
    (protocol.py: the plan the header follows, proved by verify.py): one entry each,
    ``{"sync": ..., "note": why}``."""
    bwd = kernel.backward
    plan = protocol(Params.of(bwd, kernel.config.head_dim))
    found = []
    for role in WarpRole:
        for item in plan.role(role):
            if item.is_sync:
                entry = {"sync": _sync_text(role, item)}
                if item.why or item.kind is Kind.WGMMA_COMMIT:
                    entry["note"] = item.why or _COMMIT_NOTE
                found.append(entry)
    return found


_COMMIT_NOTE = "closes a group of the wgmmas before it: the waits count groups"


def _sync_text(role: WarpRole, item: Item) -> str:
    parts = [item.kind.value]
    if item.mbar is not None:
        slot = "" if item.slot is Index.NONE else f"[{item.slot.value}]"
        parts.append(f"{item.mbar.value}{slot}")
    if item.parity is not None:
        parts.append(f"parity {item.parity.value}")
    if item.count:
        parts.append(f"count {item.count}")
    if item.tx:
        parts.append(f"tx {item.tx}")
    if item.kind in (Kind.WGMMA_WAIT, Kind.BULK_WAIT_READ, Kind.BULK_WAIT):
        parts.append(str(item.pending))
    if item.named is not None:
        parts.append(f"{item.named.value} ({item.threads} threads)")
    guard = "" if item.guard is Guard.ALWAYS else f", {item.guard.value}"
    return f"{' '.join(parts)}  [{role.value}: {item.who.value}; {item.phase.value}{guard}]"


# --- data --------------------------------------------------------------------------


def _dq_split(kernel: Kernel) -> str:
    bwd, head_dim = kernel.backward, kernel.config.head_dim
    if split_head_dim(head_dim):
        return (
            "by head_dim panels: each consumer its two 64-column panels one at a time, for all "
            f"{bwd.block_m} queries over all {bwd.block_n} keys"
        )
    if dq_by_queries(bwd):
        return (
            f"by queries (each consumer its own 64 of the {bwd.block_m}, all {head_dim} "
            f"columns, over all {bwd.block_n} keys)"
        )
    if dq_transposed(bwd):
        return (
            f"transposed: dQ^T = K^T dS^T, each consumer one 64-column panel of head_dim for "
            f"all {bwd.block_m} queries, over all {bwd.block_n} keys (dS stored with the "
            "queries as rows by stmatrix .trans)"
        )
    if dq_by_keys(bwd, head_dim):
        return (
            f"by keys (each consumer all {head_dim} columns over its own "
            f"{bwd.keys_per_consumer} keys)"
        )
    share = head_dim // bwd.consumers
    halves = "halves" if bwd.consumers == 2 else "parts"
    return f"by {halves} of head_dim ({share} columns each, over all {bwd.block_n} keys)"


def _loads(kernel: Kernel) -> dict[str, list[str]]:
    """What the producer loads: once, and per m-block through its ring(s)."""
    bwd, head_dim = kernel.backward, kernel.config.head_dim
    once = {"once per n-block": ["K (TMA)", "V (TMA)"]}
    if split_head_dim(head_dim):
        rings = (
            f"per m-block, Q and LSE through a ring of {bwd.stages} slots, dO and D through "
            f"one of {do_stages(bwd, head_dim)}"
        )
        return once | {rings: ["Q (TMA)", "LSE (bulk copy)", "dO (TMA)", "D (bulk copy)"]}
    return once | {
        f"per m-block, through a ring of {bwd.stages} slots": [
            "Q (TMA)",
            "dO (TMA)",
            "LSE (bulk copy)",
            "D (bulk copy)",
        ],
    }


def _per_m_block(kernel: Kernel) -> list[str]:
    """A consumer warpgroup's work per m-block."""
    bwd = kernel.backward
    adds = (
        "added into the fp32 accumulator from registers (red.global.add)"
        if bwd.dq_red
        else "reduce-added into the fp32 accumulator from a staging buffer"
    )
    if split_head_dim(kernel.config.head_dim):
        return [
            "S = Q K_w^T, dP = dO V_w^T  (its keys)",
            "P = exp2(S c log2(e) - LSE log2(e))  (c: softmax_scale)",
            "dS = P (dP - D)",
            "P, dS -> SMEM (stmatrix .trans, the keys as rows); both warpgroups meet",
            "dV^T += dO^T P, dK^T += Q^T dS  (its head_dim panels, all keys)",
            f"dQ^T = K^T dS^T {_dq_split(kernel)}; each panel {adds}",
        ]
    return [
        "S^T = K Q^T",
        "dP^T = V dO^T",
        "P^T = exp2(S^T c log2(e) - LSE log2(e))  (c: softmax_scale)",
        *(["dV += P^T dO  (issued before dS^T)"] if bwd.early_dv else []),
        "dS^T = P^T (dP^T - D)",
        *(
            ["dV += P^T dO  (after the dS^T store, before the meeting)"]
            if bwd.dv_before_meeting
            else []
        ),
        *([] if bwd.early_dv or bwd.dv_before_meeting else ["dV += P^T dO"]),
        *(
            _lagged_steps(kernel, adds)
            if bwd.dq_lag
            else ["dK += dS^T Q", f"dQ = dS K {_dq_split(kernel)}, {adds}"]
        ),
    ]


def _lagged_steps(kernel: Kernel, adds: str) -> list[str]:
    """`dq_lag on`'s gradient steps per m-block (`dq_first on`: dQ(i - 1) before dV(i))."""
    dq = (
        f"dQ(i - 1) = dS K {_dq_split(kernel)} once ds_full(i - 1) completes, {adds}; "
        "ds_empty(i - 1) arrived when it retires (no meeting; the last m-block's dQ after the "
        "loop)"
    )
    store = "dS^T -> SMEM (buffer i % 2), each thread arrives on its ds_full"
    if kernel.backward.dq_first:
        return [store, dq, "dV += P^T dO and dK += dS^T Q (one group, under dQ(i - 1)'s adds)"]
    return [f"{store}; dV += P^T dO", dq, "dK += dS^T Q"]


def backward_data(kernel: Kernel) -> dict[str, Any]:
    """The backward section of `fadsl explain --json`."""
    bwd = kernel.backward
    assert bwd is not None
    head_dim = kernel.config.head_dim
    plan = plan_smem(bwd, head_dim)
    threads = bwd.threads
    split = split_head_dim(head_dim)
    return {
        "settings": {
            "block_m": bwd.block_m,
            "block_n": bwd.block_n,
            "producer_warpgroups": 1,
            "consumers": bwd.consumers,
            "producer_regs": bwd.producer_regs,
            "consumer_regs": bwd.consumer_regs,
            "stages": bwd.stages,
            "deterministic": bwd.deterministic,
            "overlap": bwd.overlap,
            "early_dv": bwd.early_dv,
            "dv_before_meeting": bwd.dv_before_meeting,
            "longest_first": bwd.longest_first,
            **(
                {"dq_lag": True} if bwd.dq_lag else {}
            ),  # (only where on: older JSON keeps its keys)
            **({"dq_first": True} if bwd.dq_first else {}),
            **({"fused_convert": True} if bwd.fused_convert else {}),
            **({"dq_chains": bwd.dq_chains} if bwd.dq_chains != 1 else {}),
            # (only where packed: the forward's sections name varlen the same way)
            **({"varlen": True} if kernel.config.features.varlen else {}),
            **({"ds_stmatrix": True} if bwd.ds_stmatrix else {}),  # (dS's path: stmatrix)
            **({"dkv_tma": True} if bwd.dkv_tma else {}),  # (dK's and dV's paths: TMA)
            **({"prefetch_kv": True} if bwd.prefetch_kv else {}),
            **({"dv_out_first": True} if bwd.dv_out_first else {}),
            **({"peel_dead": True} if bwd.peel_dead else {}),
            **({"late_v": True} if bwd.late_v else {}),
        },
        "paths": [{"tensor": t.role.value, "path": t.path_text()} for t in bwd.tensors],
        "roles": [
            {
                "role": "producer",
                "warpgroups": [0],
                "threads": WARPGROUP_THREADS,
                "setmaxnreg": bwd.producer_regs,
                "loads": _loads(kernel),
            },
            {
                "role": "consumers",
                "warpgroups": list(range(1, 1 + bwd.consumers)),
                "threads": WARPGROUP_THREADS * bwd.consumers,
                "setmaxnreg": bwd.consumer_regs,
                "keys_each": bwd.keys_per_consumer,
                # head_dim 256: the columns of dK^T and dV^T each holds for every key
                **({"head_dim_each": head_dim // bwd.consumers} if split else {}),
                "per_m_block": _per_m_block(kernel),
            },
        ],
        "registers": {
            "producer": [WARPGROUP_THREADS, bwd.producer_regs],
            "consumers": [bwd.consumers, WARPGROUP_THREADS, bwd.consumer_regs],
            "used": registers_asked(bwd.producer_regs, bwd.consumers, bwd.consumer_regs),
            "pool": register_pool(threads),
            "threads": threads,
            "launch_per_thread": launch_registers(threads),
            "per_sm": REGISTERS_PER_SM,
        },
        "smem": [
            {"buffer": b.name, "offset": b.offset, "bytes": b.nbytes, "lifetime": b.lifetime}
            for b in plan.buffers
        ],
        "smem_total": plan.total,
        "smem_limit": CAPABILITIES.smem_per_cta,
        "syncs": backward_syncs(kernel),
    }


# --- text --------------------------------------------------------------------------


def backward_sections(data: Mapping[str, Any]) -> list[str]:
    """The backward section of `fadsl explain`, from ``backward_data``."""
    s = data["settings"]
    producer, consumers = data["roles"]
    regs = data["registers"]
    wgs = consumers["warpgroups"]
    once, streamed = producer["loads"].items()
    out = [
        "Backward (the spec's backward block; docs/backward.md)",
        f"  settings   B_r = {s['block_m']} queries per m-block, B_c = {s['block_n']} keys per "
        f"CTA (its n-block); {s['producer_warpgroups']} producer and {s['consumers']} consumer "
        f"warpgroups; stages {s['stages']}; deterministic {_on(s['deterministic'])}; "
        f"overlap {_on(s['overlap'])}; early_dv {_on(s['early_dv'])}"
        + ("; dv_before_meeting on" if s["dv_before_meeting"] else "")
        + ("; dq_lag on (dQ one m-block behind: no meeting)" if s.get("dq_lag") else "")
        + ("; dq_first on (that dQ issued before dV)" if s.get("dq_first") else "")
        + (
            "; fused_convert on (dQ converted by the CTA that completes each m-block, no "
            f"convert_dq up to {FUSED_CONVERT_MAX_QUERIES} queries)"
            if s.get("fused_convert")
            else ""
        )
        + (
            f"; dq_chains {s['dq_chains']} (dQ's ordered adds in {s['dq_chains']} chains of "
            "tickets per share, summed in chain order by the conversion)"
            if s.get("dq_chains")
            else ""
        )
        + (
            "; longest_first on (by L2 sections, each section's n-block 0 first)"
            if s["longest_first"]
            else ""
        )
        + (
            "; prefetch_kv on (the K and V of the CTA launched a wave later fetched into the "
            "L2 with this CTA's last loads)"
            if s.get("prefetch_kv")
            else ""
        )
        + (
            "; dv_out_first on (dV staged and stored by TMA before the last m-block's dQ)"
            if s.get("dv_out_first")
            else ""
        )
        + (
            "; peel_dead on (a warpgroup whose keys the first m-block masks skips its products "
            "there)"
            if s.get("peel_dead")
            else ""
        )
        + (
            "; late_v on (V loaded after the first m-block's Q and dO, on a barrier of its own)"
            if s.get("late_v")
            else ""
        ),
        *(
            [
                f"  varlen     packed sequences: a CTA per n-block slot of each sequence over "
                f"the packed keys (cdiv(tokens_k, {s['block_n']}) + sequences slots, found "
                f"by binary search over cu_seqlens_k); each sequence's queries start a chunk "
                f"of {s['block_m']} rows of their own in the LSE, D and dQ's accumulator; rows "
                "outside every sequence get zero gradients; the sync plan is the padded "
                "kernel's"
            ]
            if s.get("varlen")
            else []
        ),
        "  paths",
        *(f"    {p['tensor']:<4} {p['path']}" for p in data["paths"]),
        f"  producer   warpgroup 0, setmaxnreg.dec to {producer['setmaxnreg']}: warp 0 loads "
        f"{' and '.join(once[1])} {once[0]}; {', '.join(streamed[1])} {streamed[0]}",
        f"  consumers  {_warpgroups(wgs[0], len(wgs))}, setmaxnreg.inc to "
        f"{consumers['setmaxnreg']}: each "
        + (
            f"computes S and dP for {consumers['keys_each']} of the n-block's {s['block_n']} "
            f"keys, holds dK^T and dV^T of all of them for {consumers['head_dim_each']} "
            "head_dim columns and, per m-block:"
            if "head_dim_each" in consumers
            else f"owns {consumers['keys_each']} of the n-block's {s['block_n']} keys and, per "
            "m-block:"
        ),
        *(f"               {step}" for step in consumers["per_m_block"]),
        "             dK and dV accumulate in registers over the m-blocks and are stored after "
        "the last"
        + (
            " (16-bit, one K/V head per query head: staged by stmatrix in the warpgroup's "
            "rows of the dead V tile, then of K once every warpgroup's last dQ retired, each "
            "stored by its thread 0's TMA)"
            if s.get("dkv_tma")
            else ""
        ),
        f"  registers  {regs['producer'][0]} x {regs['producer'][1]} + {regs['consumers'][0]} x "
        f"{regs['consumers'][1]} x {regs['consumers'][2]} = {regs['used']} of the CTA's pool "
        f"of {regs['pool']} ({regs['threads']} threads launch with "
        f"{regs['launch_per_thread']} each; the SM has {regs['per_sm']})",
        "",
        "Backward SMEM map (fadsl/targets/sm90/backward/plan_smem.py)",
        f"  {'buffer':<10}{'offset':>7}{'bytes':>7}  lifetime",
        *(
            f"  {b['buffer']:<10}{b['offset']:>7}{b['bytes']:>7}  {b['lifetime']}"
            for b in data["smem"]
        ),
        f"backward smem total: {data['smem_total']} bytes of sm_90a's {data['smem_limit']}",
        "",
        *_syncs_text(data["syncs"]),
    ]
    return out


def _syncs_text(syncs: list[Mapping[str, Any]]) -> list[str]:
    out = [
        "Backward syncs (the main kernel's, in program order per role; placed by the sync",
        "pass fadsl/targets/sm90/backward/syncs/, proved by verify.py in the async model)",
    ]
    for sync in syncs:
        out.append(f"  >> {sync['sync']}")
        out.extend(f"       {h}" for h in sync.get("serves", ()))
        if "note" in sync:
            out.append(f"       why: {sync['note']}")
    return out
