"""What `fadsl check` and `fadsl explain` say about an sm_90a kernel beyond the common report.

Warp specialisation replaces sm_80's picture of every warp running one mainloop: the
roles and their setmaxnreg split, the TMA tiles with their mbarriers (K/V rings of
``stages`` slots, Q's and O's per-tile barriers), the schedule knobs, the named barriers, and
the schedule as one program per role. Everything is read off the kernel's IR (roles in
``who``, barriers, ring items in ``lag``, parities, counts, transaction bytes, ids).
"""

from __future__ import annotations

from typing import Any, Mapping

from ...errors import Loc
from ...ir import Kernel, Mask, Phase, Step, Sync
from ...ir.ops import Op
from .. import Capabilities, Report
from .alone import alone_name
from .backward.report import backward_data, backward_sections
from .caps import (
    MBAR_ARRIVE,
    MBAR_ARRIVE_PEER,
    MBAR_EXPECT_TX,
    MBAR_INIT,
    MBAR_WAIT,
    ROWS_PER_CONSUMER,
    WARPGROUP_THREADS,
    launch_registers,
    panel_columns,
    register_pool,
    registers_asked,
)
from .host.launch import PAIR_MIN_KV_BLOCKS
from .syncs.insert import role_of
from .plan_smem import mbarrier_count, mbarrier_offset, o_over_rings
from .verify import block_counts, max_tiles

VERIFIER = "fadsl/targets/sm90/verify.py"
ROLE_TITLES = {
    "setup": "setup (thread 0 initialises the mbarriers, then a CTA barrier)",
    "producer": "producer program (warpgroup 0; TMA loads by its elected thread)",
    "consumers": f"consumer program (each consumer warpgroup, on its {ROWS_PER_CONSUMER} query rows)",
}
PHASE_TITLES = {
    Phase.SETUP: "setup (once, before the CTA's first tile)",
    Phase.PROLOGUE: "prologue (each tile: it = 0)",
    Phase.MAINLOOP: "mainloop (once per K/V block: it = 1 .. n_blocks - 1)",
    Phase.EPILOGUE: "epilogue (it = n_blocks)",
    Phase.TEARDOWN: "teardown (once, after the CTA's last tile)",
}


def _warpgroups(first: int, count: int) -> str:
    return f"warpgroup {first}" if count == 1 else f"warpgroups {first}..{first + count - 1}"


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def narrow_rows_note(cfg) -> str:
    """Rows shorter than the swizzle's span (8-bit head_dim 64: 64 bytes) take a narrower one."""
    row = panel_columns(cfg.head_dim, cfg.dtypes[0].nbytes) * cfg.dtypes[0].nbytes
    return f"; Q, K and raw V: {row}-byte rows, {row}B" if row < cfg.ext.swizzle_bytes else ""


def check_lines(kernel: Kernel, lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    cfg = kernel.config
    hw = cfg.ext
    assert hw is not None
    consumers = (
        f"{_warpgroups(1, hw.consumers)}, setmaxnreg.inc {hw.consumer_regs}; "
        f"{ROWS_PER_CONSUMER} query rows each"
    )
    replaced = {
        "warps": f"{cfg.warps} ({cfg.threads} threads: {1 + hw.consumers} warpgroups)",
        "swizzle": f"{hw.swizzle_bytes}B (TMA writes it, wgmma reads it)" + narrow_rows_note(cfg),
        "smem": f"{kernel.smem_bytes} bytes (Q, K ring, V ring, {mbarrier_count(kernel)} "
        f"mbarriers; O {'over the dead V ring' if o_over_rings(kernel) else 'in its own bytes'})",
    }
    out: list[tuple[str, str]] = []
    for key, value in lines:
        if key == "mainloop":  # no mainloop block: the knobs below set the schedule
            continue
        out.append((key, replaced.get(key, value)))
        if key == "warps":
            out.append(
                (
                    "producer",
                    f"warpgroup 0, setmaxnreg.dec {hw.producer_regs}; "
                    "one elected thread issues every TMA load",
                )
            )
            out.append(("consumers", consumers))
    out.append(("stages", f"{hw.stages} (K and V rings of {hw.stages} slots, mbarrier pipeline)"))
    if hw.q_slots > 1:
        out.append(("q_slots", f"{hw.q_slots} (Q in a ring of {hw.q_slots} tiles)"))
    if hw.ctas_per_sm > 1:
        out.append(("per SM", f"{hw.ctas_per_sm} CTAs at once (ctas_per_sm {hw.ctas_per_sm})"))
    out.append(
        (
            "schedule",
            f"pingpong {_on(hw.pingpong)}, overlap {_on(hw.overlap)}, "
            f"scheduler {hw.scheduler}, rescale {hw.rescale}"
            + (", splits auto" if hw.split_all else ", tail split_kv" if hw.split_kv else ""),
        )
    )
    serving = [
        *(["varlen on"] if hw.varlen else []),
        *(
            [f"kv_cache {'contiguous' if hw.kv_cache == 0 else f'paged({hw.kv_cache})'}"]
            if hw.kv_cache >= 0
            else []
        ),
        *(["pack_gqa on"] if hw.pack_gqa else []),
    ]
    if serving:
        out.append(("serving", ", ".join(serving)))
    return out


def spill_advice(kernel: Kernel) -> tuple[Loc, str, str, str]:
    """setmaxnreg, not the launch, bounds the consumers' registers; the variant that the
    launches which do not pair run (alone.py) is named as that."""
    cfg, hw = kernel.config, kernel.config.ext
    loc = cfg.loc_of("registers") if "registers" in dict(cfg.key_locs) else cfg.loc_of("tile")
    which = f"its cluster-free variant {cfg.name}" if hw.alone_of else "the kernel"
    limit = f"the {hw.consumer_regs} registers per consumer thread (setmaxnreg)"
    return (
        loc,
        which,
        limit,
        "use a smaller B_c, give the consumers more registers, or turn overlap off",
    )


def register_cap(kernel: Kernel, caps: Capabilities) -> tuple[int, str]:
    """The consumers' setmaxnreg: what their code may use. The compiler reports one count
    per kernel, the allocation every thread launches with (bounded by the launch bounds)
    before setmaxnreg moves registers from the producer to the consumers."""
    hw = kernel.config.ext
    assert hw is not None
    threads = kernel.config.threads
    return hw.consumer_regs, (
        "the consumers' setmaxnreg.inc; the compiler's count is the launch allocation "
        f"before setmaxnreg: {threads} threads x {launch_registers(threads, hw.ctas_per_sm)}, "
        "the CTA's pool"
    )


# --- explain: data --------------------------------------------------------------------


def _syncs_on(kernel: Kernel, barrier: str) -> list[Sync]:
    return [s for s in kernel.syncs() if s.barrier == barrier]


def _who(syncs: list[Sync]) -> list[str]:
    return sorted({s.who.value for s in syncs})


def _mbarriers(kernel: Kernel) -> list[dict[str, Any]]:
    """Per TMA-loaded tile: its slots and the mbarriers that guard them, from their inits,
    arrivals and waits."""
    tiles: dict[str, dict[str, Any]] = {}
    for init in (s for s in kernel.syncs() if s.kind is MBAR_INIT):
        uses = _syncs_on(kernel, init.barrier)
        arrivals = [s for s in uses if s.kind in (MBAR_ARRIVE, MBAR_ARRIVE_PEER, MBAR_EXPECT_TX)]
        waits = [s for s in uses if s.kind is MBAR_WAIT]
        buffer = next(h.earlier_buffer for s in uses for h in s.serves)
        buf = kernel.buffer(buffer)
        ring = any(s.lag is not None for s in uses)
        tile = tiles.setdefault(
            buffer,
            {
                "buffer": buffer,
                "ring": ring,
                "slots": buf.slots,
                "slot_bytes": buf.tile_bytes,
                "offset": buf.offset,
                "mbarriers": [],
            },
        )
        tile["mbarriers"].append(
            {
                "mbarrier": init.barrier,
                "per_slot": ring or init.slots > 1,
                "arrivals": init.count,
                "arrive": sorted({f"{s.kind.name} by {s.who.value}" for s in arrivals}),
                "tx_bytes": max((s.tx for s in arrivals), default=0),
                "waited_by": _who(waits),
                "parity": sorted({s.parity.value for s in waits if s.parity is not None}),
            }
        )
    return list(tiles.values())


def _named_barriers(kernel: Kernel) -> list[dict[str, Any]]:
    hw = kernel.config.ext
    assert hw is not None
    found: dict[str, dict[str, Any]] = {}
    for s in kernel.syncs():
        if s.bar_id < 0:
            continue
        entry = found.setdefault(
            s.barrier, {"barrier": s.barrier, "ids": set(), "threads": s.count, "uses": set()}
        )
        ids = [s.bar_id] if s.peer is None else [s.bar_id + wg for wg in range(hw.consumers)]
        entry["ids"].update(ids)
        entry["uses"].add(f"{s.kind.name} id={s.bar_id_text()} by {s.who.value}")
    return [
        {**e, "ids": sorted(e["ids"]), "uses": sorted(e["uses"])}
        for e in sorted(found.values(), key=lambda e: min(e["ids"]))
    ]


def _entry(item: Step | Sync) -> dict[str, Any]:
    if isinstance(item, Step):
        return {"step": item.op.spelling, "what": item.title, "who": item.who.value}
    entry: dict[str, Any] = {
        "sync": item.text(),
        "line": item.loc.line,
        "serves": [h.describe() for h in item.serves],
    }
    if item.note:
        entry["note"] = item.note
    return entry


def _programs(kernel: Kernel) -> list[dict[str, Any]]:
    programs = []
    for role in ROLE_TITLES:
        phases = []
        for phase, items in kernel.phases():
            mine = [_entry(i) for i in items if role_of(i.who) == role]
            if mine:
                phases.append({"phase": phase.value, "items": mine})
        programs.append({"role": role, "phases": phases})
    return programs


def explain_data(kernel: Kernel) -> dict[str, Any]:
    cfg = kernel.config
    hw = cfg.ext
    assert hw is not None
    counts = block_counts(kernel)
    consumer_threads = WARPGROUP_THREADS * hw.consumers
    return {
        "warp_specialisation": {
            "warpgroups": 1 + hw.consumers,
            "roles": [
                {
                    "role": "producer",
                    "warpgroups": [0],
                    "threads": WARPGROUP_THREADS,
                    "setmaxnreg": hw.producer_regs,
                    "issues": "every TMA load, by one elected thread",
                },
                {
                    "role": "consumers",
                    "warpgroups": list(range(1, 1 + hw.consumers)),
                    "threads": consumer_threads,
                    "setmaxnreg": hw.consumer_regs,
                    "rows_per_warpgroup": ROWS_PER_CONSUMER,
                },
            ],
            "registers_per_sm": {
                "used": registers_asked(hw.producer_regs, hw.consumers, hw.consumer_regs),
                "available": register_pool(WARPGROUP_THREADS * (1 + hw.consumers), hw.ctas_per_sm),
            },
            **({"ctas_per_sm": hw.ctas_per_sm} if hw.ctas_per_sm > 1 else {}),
            "stages": hw.stages,
            "q_slots": hw.q_slots,
            # 8-bit kernels: the producer warps transpose V into Vt (fp8-forward.md §3.3)
            **(
                {"transpose_v": True} if any(s.op is Op.TRANSPOSE_V for s in kernel.steps()) else {}
            ),
            "tail": "split_kv" if hw.split_kv else "whole",
            **({"cluster": hw.cluster} if hw.cluster > 1 else {}),
            # the kernel the launches that do not pair run (sm90/alone.py)
            **({"alone": alone_name(kernel.config.name)} if hw.cluster > 1 else {}),
            **({"alone_of": hw.alone_of} if hw.alone_of else {}),
            "pingpong": hw.pingpong,
            "overlap": hw.overlap,
            "scheduler": hw.scheduler,
            # longest_tiles_first (sm90.cuh): causal, or a keep without a window
            "longest_first": (cfg.mask is Mask.CAUSAL or _keeps(cfg)) and not cfg.window,
            "rescale": hw.rescale,
            **({"softcap": hw.softcap} if hw.softcap else {}),
            **({"varlen": True} if hw.varlen else {}),
            **({"kv_cache": hw.kv_cache} if hw.kv_cache >= 0 else {}),
            **({"pack_gqa": True} if hw.pack_gqa else {}),
            **({"splits": "auto"} if hw.split_all else {}),
            **(
                {
                    "window": {
                        "left": cfg.window.left,
                        "right": cfg.window.right,
                        "causal": cfg.mask is Mask.CAUSAL,
                    }
                }
                if cfg.window
                else {}
            ),
        },
        "tma_tiles": _mbarriers(kernel),
        "mbarrier_array": {
            "count": mbarrier_count(kernel),
            "offset": mbarrier_offset(kernel),
            "bytes": 8 * mbarrier_count(kernel),
        },
        "named_barriers": _named_barriers(kernel),
        "verified": {
            "by": VERIFIER,
            "block_counts": [counts.start, counts.stop - 1],
            "tiles": [1, max_tiles(kernel)],
            # `cluster 2`: the proof runs both CTAs of a cluster (cluster_agents)
            **({"ctas": hw.cluster} if hw.cluster > 1 else {}),
        },
        "programs": _programs(kernel),
    }


# --- explain: text --------------------------------------------------------------------


def explain_sections(data: Mapping[str, Any]) -> list[str]:
    ws = data["warp_specialisation"]
    producer, consumers = ws["roles"]
    regs = ws["registers_per_sm"]
    wgs = consumers["warpgroups"]
    # split pieces of an 8-bit kernel (`splits auto`'s combine kernel, the tail split's last
    # piece) merge in the 16-bit pieces' units
    eight_bit_pieces = (
        "; 8-bit pieces write O with rho undone and times v_descale, and R = m c' - 8 for m, "
        "so that the merge, at scale 1, reads no descale (fp8_piece_partial)"
        if ws.get("transpose_v")
        else ""
    )
    out = [
        f"Warp specialisation ({data['warps']} warps = {ws['warpgroups']} warpgroups of "
        f"{WARPGROUP_THREADS} threads)",
        f"  producer   warpgroup 0, setmaxnreg.dec to {producer['setmaxnreg']} registers: "
        f"one elected thread issues every TMA load (Q per tile, K and V per block)"
        + ("; its 4 warps transpose each V block into Vt" if ws.get("transpose_v") else ""),
        f"  consumers  {_warpgroups(wgs[0], len(wgs))}, setmaxnreg.inc to "
        f"{consumers['setmaxnreg']} registers: {consumers['rows_per_warpgroup']} query rows "
        f"each (B_r = {data['block_r']})",
        f"  registers  {producer['threads']} x {producer['setmaxnreg']} + "
        f"{consumers['threads']} x {consumers['setmaxnreg']} = {regs['used']} of the CTA's "
        f"launch allocation, {regs['available']}"
        + (
            f" (ctas_per_sm {ws['ctas_per_sm']}: that many CTAs share an SM's 65536)"
            if ws.get("ctas_per_sm", 1) > 1
            else ""
        ),
        f"  stages     {ws['stages']}: "
        f"{'K, V and Vt' if ws.get('transpose_v') else 'K and V'} each in a ring of "
        f"{ws['stages']} slots",
        "  q_slots    "
        + (
            f"{ws['q_slots']}: Q in a ring of {ws['q_slots']} tiles; the producer loads the next "
            "tile's Q while this one runs"
            if ws["q_slots"] > 1
            else "1: one Q tile; the producer loads the next tile's Q once every consumer warp "
            "is done with this one's"
        ),
        "  pingpong   "
        + (
            "on: the consumer warpgroups take turns issuing wgmma (named barrier 'turn')"
            if ws["pingpong"]
            else "off: the consumer warpgroups issue wgmma without turns"
        ),
        "  overlap    "
        + (
            "on: S(j+1) = Q K^T is in flight during softmax(j)"
            if ws["overlap"]
            else "off: each GEMM is waited for before the next step"
        ),
        "  scheduler  "
        + (
            "persistent: one CTA per SM (at most one per tile), each running tiles in turn "
            + (
                "(varlen: the padded order sequence by sequence, the longest K/V loops first)"
                if "varlen" in ws
                else (
                    "(splits auto: every tile's pieces in turn)"
                    if "splits" in ws
                    else (
                        "(a window's in plain order)"
                        if "window" in ws
                        else (
                            "(a long and a short query block in pairs: causal, or a keep)"
                            if ws.get("longest_first")
                            else "(in order)"
                        )
                    )
                )
            )
            + "; the producer loads the next tile's Q and K "
            + (
                "during this one's last blocks"
                if ws["q_slots"] > 1
                else "during this one's epilogue"
            )
            if ws["scheduler"] == "persistent"
            else "grid: one CTA per tile"
        ),
        "  tail       "
        + (
            "split into pieces (splits auto): every tile's K/V blocks, as many pieces as fill "
            "the SMs in one wave; each piece's warpgroups write their partial O, m and l to a "
            "workspace and skip the tile's tail, and <kernel>_combine adds them up after the "
            "launch (a programmatic dependent: placed while the pieces run, it waits for them)"
            + eight_bit_pieces
            if "splits" in ws
            else (
                "split_kv: the launch's last, part-full round of tiles runs as pieces of their K/V "
                "blocks on the CTAs that would idle; each piece's warpgroup hands its partial O, m "
                "and l over in global memory (named barrier 8+wg, outside the SMEM plan), and the "
                "last to finish a tile combines them and stores it (the others skip the tail)"
                + eight_bit_pieces
                if ws["tail"] == "split_kv"
                else "whole: each tile runs all its K/V blocks in one CTA"
            )
        ),
        *(
            [
                f"  cluster    {ws['cluster']}: pairs of CTAs on neighbouring query blocks of one "
                "head share each K/V block, each loading half its panels by TMA multicast into "
                "both; launched in pairs when a head's query blocks pair up and the K/V loop "
                f"has {PAIR_MIN_KV_BLOCKS} blocks or more (fadsl.targets.sm90.host.launch.launch_cluster); other "
                f"launches run the spec's cluster-free variant, {ws['alone']} (compiled and "
                "verified beside it: no cluster barrier)"
            ]
            if "cluster" in ws
            else []
        ),
        *(
            [
                f"  alone      the cluster-free variant of {ws['alone_of']}: the runtime launches "
                "it where a launch does not pair CTAs"
            ]
            if "alone_of" in ws
            else []
        ),
        "  rescale    "
        + (
            {
                "lazy": "lazy: a row keeps the max its P and O refer to until the max grows past "
                "2^8 of it (every P <= 2^8); O is multiplied only in the blocks where some row "
                "of the warp moved",
                "guarded": "guarded: lazy, and a tile's blocks after its first skip the row max: "
                "P against the kept max, checked by the partial row sums (each P <= "
                "(B_c / 4) 2^8; a sum past it moves the max by a factor >= 2^-120; one past "
                "2^120, inf or NaN recomputes S from SMEM)",
                "every": "every: O and l are rescaled to the new row max after each block "
                "(every P <= 1)",
            }[ws["rescale"]]
        ),
        (
            "             8-bit: P offset by 2^8, lazy slack 0.8 (P <= 2^8.8 < 448) and P rounded "
            "to e4m3 (research/fp8-forward.md §3.5, §4; tests/fp8_softmax_model.py)"
            if ws.get("transpose_v")
            else "             exact up to the 16-bit rounding of P for finite scores s with "
            "|s softmax_scale log2(e)| < 2^16: every factor applied is a normal fp32 number, "
            "or a true value below 2^-126 of the row's total flushed to 0 (docs/numerics.md)"
        ),
        *(
            [
                f"  softcap    {ws['softcap']}: scores capped by {ws['softcap']} tanh(s "
                f"softmax_scale / {ws['softcap']}) before the mask and the softmax (tanh from "
                "ex2 and rcp: absolute error about 2^-21 of the cap)"
            ]
            if "softcap" in ws
            else []
        ),
        *([_window_text(ws["window"])] if "window" in ws else []),
        *([VARLEN_TEXT] if "varlen" in ws else []),
        *([_kv_cache_text(ws["kv_cache"])] if "kv_cache" in ws else []),
        *([PACK_GQA_TEXT] if "pack_gqa" in ws else []),
        "",
    ]
    array = data["mbarrier_array"]
    out.append(
        f"TMA tiles and their mbarriers ({array['count']} mbarriers, {array['bytes']} bytes at "
        f"offset {array['offset']}, after the rings)"
    )
    for tile in data["tma_tiles"]:
        name, slots = tile["buffer"], tile["slots"]
        if tile["ring"]:
            out.append(
                f"  {name}  ring of {slots} slot{'s' if slots > 1 else ''} x {tile['slot_bytes']} "
                f"bytes at offset {tile['offset']}; block i in slot i % {slots}, "
                f"phase (i / {slots}) & 1; per slot:"
            )
        elif slots > 1:
            out.append(
                f"  {name}  ring of {slots} tiles x {tile['slot_bytes']} bytes at offset "
                f"{tile['offset']}; CTA tile t in slot t % {slots}, phase (t / {slots}) & 1; "
                "per slot:"
            )
        else:
            out.append(
                f"  {name}  one tile of {tile['slot_bytes']} bytes at offset {tile['offset']}, "
                "per CTA tile t (phase t & 1):"
            )
        for bar in tile["mbarriers"]:
            tx = f" + {bar['tx_bytes']} transaction bytes" if bar["tx_bytes"] else ""
            out.append(
                f"       {bar['mbarrier']:<8} {bar['arrivals']} arrival"
                f"{'s' if bar['arrivals'] > 1 else ''}{tx} ({', '.join(bar['arrive'])}); "
                f"waited by {', '.join(bar['waited_by'])} at parity {', '.join(bar['parity'])}"
            )
    out.append("")
    out.append("Named barriers (id 0 is __syncthreads: every thread)")
    for bar in data["named_barriers"]:
        ids = bar["ids"]
        id_text = f"id {ids[0]}" if len(ids) == 1 else f"ids {ids[0]}..{ids[-1]}"
        out.append(f"  {bar['barrier']:<10} {id_text:<9} {bar['threads']} threads")
        out.extend(f"             {use}" for use in bar["uses"])
    counts = data["verified"]["block_counts"]
    tiles = data["verified"]["tiles"]
    out += [
        "",
        f"Verified: {data['verified']['by']} proves this plan (every hazard ordered, no wait "
        f"left hanging) over the async model for {_proven_for(data['verified'])} "
        f"{tiles[0]}-{tiles[1]} tiles in turn, each of {counts[0]}..{counts[1]} K/V blocks (up "
        "to stages + 2; empty tiles touch no SMEM)"
        + (
            "; and with any one warpgroup, or all, skipping a tile's tail (a split piece)"
            if data["warp_specialisation"]["tail"] == "split_kv"
            else ""
        ),
        "",
    ]
    return out


VARLEN_TEXT = (
    "  varlen     on: q, k, v and o packed as (tokens, heads, head_dim), sequence b at rows "
    "cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (causal aligned per sequence); a one-CTA kernel "
    "first lists the sequences, longest K/V loop first, and the tiles follow the list, each "
    "sequence's in the padded order, so that no tile straddles two sequences; O's TMA store "
    "stops at its sequence's end (a ragged map); the sync plan is the padded kernel's"
)


PACK_GQA_TEXT = (
    "  pack_gqa   on: a tile's rows are (query row, query head) pairs of one K/V head (row r: "
    "query row r / G of query head head x G + r % G, G = heads_q / heads_kv dividing 64); Q "
    "and O move as 5-D TMA boxes and the tiles run over K/V heads"
)


def _kv_cache_text(page: int) -> str:
    where = (
        "a contiguous (batch, capacity, heads_kv, head_dim) cache"
        if page == 0
        else f"a paged (pages, {page}, heads_kv, head_dim) cache through a page table, "
        "one TMA box per page or per block, whichever is smaller"
    )
    return (
        f"  kv_cache   {'contiguous' if page == 0 else f'paged({page})'}: K and V from {where}; "
        "batch b's keys are its first cache_seqlens[b] rows (clamped to the capacity); "
        "kern.kvcache(...), fadsl.append_kv(...)"
    )


def _window_text(window: Mapping[str, Any]) -> str:
    left, right = window["left"], window["right"]
    spelt = f"causal, window({left})" if window["causal"] else f"window({left}, {right})"
    return (
        f"  window     {spelt}: query i sees keys i + d - {left} .. i + d + {right} (d = "
        "seqlen_k - seqlen_q); each tile runs only the K/V blocks its rows' windows reach, "
        "masking the first and the last, and the tiles go in plain order (about the same "
        "number of blocks each)"
    )


def _proven_for(verified: Mapping[str, Any]) -> str:
    """Whose programs the proof runs: one CTA's, or every CTA's of a cluster."""
    ctas = verified.get("ctas", 1)
    if ctas == 1:
        return "a CTA running"
    return (
        f"a CTA launched alone and for {'both' if ctas == 2 else f'all {ctas}'} CTAs of a "
        "cluster (K/V multicast in shares, arrivals on the peer's empty barriers, the cluster "
        "barrier after init and at exit), each running the same"
    )


def explain_schedule(data: Mapping[str, Any]) -> list[str]:
    out = [
        "Schedule per role (each sync with the hazards it orders, or why; [it+lag]: the ring "
        "slot of K/V block it + lag)"
    ]
    titles = {p.value: t for p, t in PHASE_TITLES.items()}
    for program in data["programs"]:
        if not program["phases"]:
            continue
        out.append(f"  {ROLE_TITLES[program['role']]}")
        for phase in program["phases"]:
            indent = "    "
            if program["role"] != "setup":
                out.append(f"    {titles[phase['phase']]}")
                indent = "      "
            for item in phase["items"]:
                if "step" in item:
                    out.append(f"{indent}{item['step']:<10} {item['what']}")
                    continue
                out.append(f"{indent}>> {item['sync']}")
                out.extend(f"{indent}     {h}" for h in item["serves"])
                if "note" in item:
                    out.append(f"{indent}     why: {item['note']}")
    return out


def threads_text(kernel: Kernel) -> str:
    hopper = kernel.config.ext
    assert hopper is not None
    return f"{1 + hopper.consumers} warpgroups (1 producer, {hopper.consumers} consumer)"


REPORT = Report(
    check_lines=check_lines,
    threads_text=threads_text,
    register_cap=register_cap,
    spill_advice=spill_advice,
    explain_data=explain_data,
    explain_sections=explain_sections,
    explain_schedule=explain_schedule,
    backward_data=backward_data,  # the backward block: settings, roles, registers, SMEM map
    backward_sections=backward_sections,
)


def _keeps(cfg) -> bool:
    """Whether the spec has a `keep` (its tiles' work grows with the query block there)."""
    return cfg.modifiers is not None and cfg.modifiers.keep is not None
