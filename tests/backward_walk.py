"""The walk behind tests/backward_header.py: a function of the backward header, its
statements (tests/cpp_reader.py) interpreted for one configuration, turned into the calls
the protocol's items name (``Call``): which callees are traced and as what Kind, which
are inlined, and how their operands resolve (SMEM offsets and panels, mbarriers, parities,
registers). backward_header.py's docstring says what the walk decides and how."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from fadsl.targets.sm90.backward.program import (
    StagedTile,
    Guard,
    Index,
    Kind,
    Mbar,
    Params,
    WaitParity,
    Part,
    LoopPhase,
    Reg,
    CodeSite,
    Who,
)

from cpp_reader import function, group, param_name, split_args, squash, statements

# the functions a role's walk inlines, with the source their calls are tagged with
INLINED = {
    "ordered_reduce_add": CodeSite.ORDERED_REDUCE_ADD,
    "reduce_dq": CodeSite.REDUCE_DQ,
    "meet_and_issue_dq": CodeSite.MEET_AND_ISSUE_DQ,
    "bwd_load_kv": CodeSite.LOAD_KV,
    "bwd_load_v_late": CodeSite.LOAD_V_LATE,  # `late_v on`
    "release_dq_ticket": CodeSite.RELEASE_DQ_TICKET,
    "issue_dq_lagged": CodeSite.ISSUE_DQ_LAGGED,
}


@dataclass(frozen=True)
class Call:
    kind: Kind
    who: Who
    phase: LoopPhase
    guard: Guard
    source: CodeSite
    detail: tuple


TRACED = {
    "mbar_init": Kind.MBAR_INIT,
    "fence_mbarrier_init": Kind.FENCE_MBAR_INIT,
    "__syncthreads": Kind.SYNCTHREADS,
    "mbar_wait_parity": Kind.MBAR_WAIT,
    "mbar_arrive": Kind.MBAR_ARRIVE,
    "mbar_arrive_expect_tx": Kind.MBAR_ARRIVE_EXPECT_TX,
    "wgmma_fence": Kind.WGMMA_FENCE,
    "wgmma_commit": Kind.WGMMA_COMMIT,
    "wgmma_wait": Kind.WGMMA_WAIT,
    "fence_proxy_async_smem": Kind.FENCE_PROXY_ASYNC_SMEM,
    "fence_proxy_async_global": Kind.FENCE_PROXY_ASYNC_GLOBAL,
    "named_bar_sync": Kind.NAMED_BAR_SYNC,
    "named_bar_arrive": Kind.NAMED_BAR_ARRIVE,
    "__syncwarp": Kind.SYNCWARP,
    "tma_store_commit": Kind.BULK_COMMIT,
    "tma_store_wait_read": Kind.BULK_WAIT_READ,
    "bulk_wait_all": Kind.BULK_WAIT,
    "ld_acquire_gpu": Kind.SEM_ACQUIRE,
    "st_release_gpu": Kind.SEM_RELEASE,
    "tma_load_4d": Kind.TMA_LOAD,
    "bulk_load": Kind.BULK_LOAD,
    "issue_keys_by_rows": Kind.WGMMA,
    "issue_grad_kv": Kind.WGMMA,
    "issue_dq": Kind.WGMMA,
    "issue_dq_t": Kind.WGMMA,
    "issue_rows_by_keys": Kind.WGMMA,  # head_dim 256's (sm90_bwd_split.cuh)
    "issue_grad_panel_t": Kind.WGMMA,
    "issue_dq_panel_t": Kind.WGMMA,
    "bwd_probs": Kind.PROBS,
    "bwd_probs_rows": Kind.PROBS,
    "bwd_grad_scores": Kind.GRAD_SCORES,
    "bwd_grad_scores_rows": Kind.GRAD_SCORES,
    "load_row_pairs": Kind.LOAD_ROWS,
    "pack_pairs": Kind.PACK,
    "store_ds": Kind.ST_SHARED,
    "store_ds_t": Kind.ST_SHARED,
    "store_ds_stmatrix": Kind.ST_SHARED,
    "store_keys_t": Kind.ST_SHARED,
    "stage_dq": Kind.ST_SHARED,
    "bulk_reduce_add_f32": Kind.BULK_REDUCE_ADD,
    # (the writer's: a store for its chain's first ticket, else the reduce-add; one bulk group)
    "bulk_store_or_add_f32": Kind.BULK_REDUCE_ADD,
    "red_add_dq": Kind.RED_GLOBAL,
    "store_grad_kv": Kind.STORE_GLOBAL,
    "store_grad_kv_t": Kind.STORE_GLOBAL,
    "stage_grad_kv": Kind.ST_SHARED,  # dK's and dV's rows into the dead K and V tiles
    "store_grad_kv_tma": Kind.TMA_STORE,
}
# the callees whose operands name SMEM, by argument position
SMEM_ARGS = {"issue_keys_by_rows": (1, 2), "issue_grad_kv": (2,), "issue_dq": (1, 2)}
SMEM_ARGS |= {"issue_dq_t": (1, 2), "store_ds_t": (0,)}
# (bwd_probs' 9th: the D it loads under P's exponentials, in the lagged consumer)
SMEM_ARGS |= {"bwd_probs": (3, 8), "bwd_grad_scores": (3,), "store_ds": (0,), "stage_dq": (0,)}
SMEM_ARGS |= {"load_row_pairs": (0,)}
# (an argument naming registers, such as the row values loaded ahead, reads no SMEM)
SMEM_ARGS |= {"bulk_reduce_add_f32": (1,), "tma_load_4d": (0,), "bulk_load": (0,)}
SMEM_ARGS |= {"bulk_store_or_add_f32": (1,)}
SMEM_ARGS |= {"issue_rows_by_keys": (1, 2), "issue_grad_panel_t": (1, 2)}
SMEM_ARGS |= {"issue_dq_panel_t": (1, 2), "bwd_probs_rows": (3,), "bwd_grad_scores_rows": (3,)}
SMEM_ARGS |= {"store_keys_t": (0,), "store_ds_stmatrix": (0,)}
SMEM_ARGS |= {"stage_grad_kv": (0,), "store_grad_kv_tma": (0,)}
REGISTERS = {"s": Reg.S, "dp": Reg.DP, "p16": Reg.P16, "ds16": Reg.DS16}
REGISTERS |= {"dk": Reg.DK, "dv": Reg.DV, "dq": Reg.DQ}
REGISTERS |= {"lse": Reg.LSE, "d_sums": Reg.D}  # the lagged consumer's RowPairs
REGISTERS |= {"zeros": Reg.ZEROS}  # `peel_dead on`: a peeled m-block's dS^T rows
OFFSETS = {
    "kOffK": StagedTile.K,
    "kOffV": StagedTile.V,
    "kOffQ": StagedTile.Q,
    "kOffDO": StagedTile.DO,
}
OFFSETS |= {"kOffDS": StagedTile.DS, "kOffDQ": StagedTile.DQ_STAGE, "kOffLSE": StagedTile.LSE}
OFFSETS |= {"kOffD": StagedTile.D, "kOffP": StagedTile.P}
MBARS = {"bwd_bar_kv": Mbar.KV_FULL, "bwd_bar_q_full": Mbar.Q_FULL}
MBARS |= {"bwd_bar_q_empty": Mbar.Q_EMPTY, "bwd_bar_kv_empty": Mbar.KV_EMPTY}
MBARS |= {"bwd_bar_do_full": Mbar.DO_FULL, "bwd_bar_do_empty": Mbar.DO_EMPTY}
MBARS |= {"bwd_bar_ds_full": Mbar.DS_FULL, "bwd_bar_ds_empty": Mbar.DS_EMPTY}  # dq_lag
MBARS |= {"bwd_bar_v_late": Mbar.V_FULL}  # `late_v on`
# head_dim 256: a 64-column panel of K (B_c rows) or of a Q or dO slot (B_r rows)
PANEL_BYTES = {StagedTile.K: "kBlockN*kRowBytes", StagedTile.Q: "kBlockM*kRowBytes"}
PANEL_BYTES |= {StagedTile.DO: "kBlockM*kRowBytes"}


def evaluate(expr: str, env: dict, **names) -> int:
    expr = re.sub(r"\bCfg::", "", expr).replace("/", "//")
    expr = re.sub(r"\b(\d+)u\b", r"\1", expr)
    expr = re.sub(r"^(.*?)\?(.*?):(.*)$", r"((\2) if (\1) else (\3))", expr)
    expr = expr.replace("true", "True").replace("false", "False")
    expr = expr.replace("&&", " and ").replace("||", " or ")
    expr = re.sub(r"!(?!=)", " not ", expr)
    return eval(expr, {"__builtins__": {}}, {**env, **names})  # noqa: S307 (the header's)


@dataclass
class Walk:
    """The state of the walk through one function for one configuration."""

    params: Params
    env: dict
    source: CodeSite
    who: Who
    variables: dict
    calls: list
    header: str  # the text the inlined functions are read from
    phase: LoopPhase = LoopPhase.BEFORE
    guard: Guard = Guard.ALWAYS
    returned: bool = False  # the function returned (the rest of it is not walked)

    def fork(self, **changes) -> Walk:
        return replace(self, variables=dict(self.variables), calls=[], **changes)


def expand(expr: str, variables: dict) -> str:
    for _ in range(10):
        new = re.sub(
            r"\b\w+\b", lambda w: f"({variables[w[0]]})" if w[0] in variables else w[0], expr
        )
        if new == expr:
            return squash(expr)
        expr = new
    raise AssertionError(f"variables do not resolve: {expr}")


def running(flat: str, walk: Walk) -> str:
    """The ring's and dS^T's index: the CTA's running m-block, run.m0 + i (BwdRun: 0 with one
    tile per CTA, so i there); with `scheduler persistent` a bare i (the tile's own m-block,
    a ring restarted per tile) is left as `tile-local i`, which no plan's index reads as."""
    if walk.guard is Guard.LAGGED:  # the m-block a lagged call acts for: its running index
        flat = flat.replace("(run.m0+i)", "(current)")  # (m-block i's own: no plan index)
        flat = flat.replace("((current)-1)", "(run.m0+i)")  # prev, in m-block i
        flat = flat.replace("(run.m0+b.m_count-1)", "(run.m0+i)")  # last, after the loop
    if walk.phase is LoopPhase.PEELED:  # `peel_dead on`: the first m-block, run.m0 (i = 0)
        flat = flat.replace("(run.m0)", "i")
    if walk.params.persistent:
        flat = re.sub(r"(?<![\w.+])i(?=[%/])", "tile-local i", flat)
    return flat.replace("(run.m0+i)", "i")


def index_of(flat: str) -> Index:
    if "i%Cfg::kStages" in flat and "tile-local" not in flat:
        return Index.RING
    if "tile-local" in flat:
        return flat  # (matches no Index)
    if "i%Cfg::kDoStages" in flat:
        return Index.RING_DO
    return Index.ALTERNATE if "i%2" in flat else Index.NONE


# one-line address helpers of the header, whose bodies the walk reads in place of their calls
ADDRESS_HELPERS = ("bwd_dq_stage",)  # (sm90_bwd_dq_reduce.cuh: a share's dQ staging)


def inline_address_helpers(flat: str, header: str) -> str:
    """``flat`` with each call of an ADDRESS_HELPERS function replaced by the expression its
    body in ``header`` returns, the call's arguments in place of its parameters."""
    for name in ADDRESS_HELPERS:
        if f"{name}<" not in flat:
            continue
        names, returned = _helper(name, header)

        def inlined(call: re.Match) -> str:
            out = returned
            for param, arg in zip(names, split_args(call[1]), strict=True):
                out = re.sub(rf"\b{param}\b", f"({arg})", out)
            return f"({out})"

        flat = re.sub(rf"\b{name}<Cfg>\(((?:[^()]|\([^()]*\))*)\)", inlined, flat)
    return flat


@functools.lru_cache(maxsize=None)
def _helper(name: str, header: str) -> tuple[list[str], str]:
    """An address helper's parameter names and the expression it returns."""
    params, body = function(header, rf"uint32_t {name}\(")
    (returned,) = re.findall(r"return(.+?);", squash(body))
    return [param_name(p) for p in split_args(params)], returned


def operand(expr: str, walk: Walk) -> tuple:
    flat = inline_address_helpers(expand(expr, walk.variables), walk.header)
    (offset,) = {OFFSETS[name] for name in re.findall(r"Cfg::(kOff\w+)", flat)}
    if re.search(r"\b2\*wg\b", flat):  # head_dim 256: panel 2 wg + n of K, Q or dO
        at = lambda text: evaluate(text, walk.env, smem=0, wg=0, i=0)  # noqa: E731
        base = next(name for name, tile in OFFSETS.items() if tile is offset)
        n = (at(flat) - at(base)) // at(PANEL_BYTES[offset])
        return offset, index_of(running(flat, walk)), Part.WG_PANEL, n
    if re.search(r"\bwg\b", flat):  # wg panel strides (B_c rows each), or wg's 64 rows
        panel = re.search(r"kBlockN|kDSPanelBytes", flat)
        part = Part.PANEL_OF_WG if panel else Part.ROWS_OF_WG
    else:
        part = Part.PANEL if re.search(r"\bpanel\b", flat) else Part.WHOLE
    return offset, index_of(running(flat, walk)), part


def mbar_of(expr: str, walk: Walk) -> tuple:
    flat = expand(expr, walk.variables)
    (mbar,) = {MBARS[name] for name in re.findall(r"(bwd_bar_\w+)<", flat)}
    return mbar, index_of(running(flat, walk))


def parity_of(expr: str, walk: Walk) -> WaitParity:
    flat = running(expand(expr, walk.variables), walk)
    if flat in ("0u", "0", "1u", "1"):
        return WaitParity.ZERO if flat.startswith("0") else WaitParity.ONE
    if "run.kv" in flat:  # `scheduler persistent`: K and V's barriers by the tile's round
        assert "&1" in flat, flat
        return WaitParity.TILE_FLIP if "^1" in flat else WaitParity.TILE
    if "tile-local" in flat or "(i-1)" in flat or "current" in flat:
        return flat  # (matches no WaitParity: a lagged call read as its m-block's, or not)
    if re.search(r"\bi/2\b", flat):  # `dq_lag on`: a dS^T buffer's uses
        assert "&1" in flat and "^" not in flat, flat
        return WaitParity.ALTERNATE_PREVIOUS if "i/2-1" in flat else WaitParity.ALTERNATE
    if "i/Cfg::kDoStages" in flat:
        assert "&1" in flat, flat
        return WaitParity.RING_DO_FLIP if "^1" in flat else WaitParity.RING_DO
    assert "i/Cfg::kStages" in flat and "&1" in flat, flat
    return WaitParity.RING_FLIP if "^1" in flat else WaitParity.RING


def detail_of(name: str, args: list[str], template: str, walk: Walk) -> tuple:
    kind = TRACED[name]
    positions = [n for n in SMEM_ARGS.get(name, ()) if n < len(args)]
    smem = [operand(args[n], walk) for n in positions if args[n] not in REGISTERS]
    number = lambda expr, **k: evaluate(expr, walk.env, **k)  # noqa: E731
    match kind:
        case Kind.MBAR_INIT:
            return mbar_of(args[0], walk) + (number(args[1]),)
        case Kind.MBAR_WAIT:
            return mbar_of(args[0], walk) + (parity_of(args[1], walk),)
        case Kind.MBAR_ARRIVE:
            return mbar_of(args[0], walk)
        case Kind.MBAR_ARRIVE_EXPECT_TX:
            return mbar_of(args[0], walk) + (number(args[1]),)
        case Kind.WGMMA_WAIT | Kind.BULK_WAIT_READ:
            return (number(template),)
        case Kind.BULK_WAIT:
            return (0,)
        case Kind.NAMED_BAR_SYNC | Kind.NAMED_BAR_ARRIVE:  # (the writer's w: its consumer's wg)
            ids = tuple(number(args[0], wg=wg, w=wg) for wg in range(walk.params.consumers))
            return ids, number(args[1])
        case Kind.TMA_LOAD | Kind.BULK_LOAD:
            barrier = args[2] if kind is Kind.TMA_LOAD else args[3]
            return mbar_of(barrier, walk) + smem[0][:2]
        case Kind.WGMMA:  # (dk[0]: a head_dim panel's accumulator at head_dim 256)
            return REGISTERS[re.sub(r"\[\d+\]$", "", args[0])], frozenset(smem)
        case Kind.PROBS | Kind.GRAD_SCORES:  # (D's RowPairs inside bwd_probs' prefetch)
            words = [w for a in args for w in re.findall(r"\b\w+\b", a)]
            regs = tuple(dict.fromkeys(REGISTERS[w] for w in words if w in REGISTERS))
            return frozenset(op[:2] for op in smem), regs
        case Kind.LOAD_ROWS:
            return (frozenset(op[:2] for op in smem),)
        case Kind.PACK:
            return (REGISTERS[args[0]],), (REGISTERS[args[1]],)
        case Kind.ST_SHARED:  # (which store: st.shared, stmatrix or stmatrix .trans)
            return smem[0][:2], REGISTERS[args[1]], name
        case Kind.BULK_REDUCE_ADD | Kind.TMA_STORE:
            return (smem[0][0],)
        case Kind.STORE_GLOBAL:
            return (REGISTERS[args[0]],)
        case Kind.RED_GLOBAL:
            return (REGISTERS[args[1]],)
    return ()


CALL = re.compile(r"\b(\w+)\s*(?:<([^<>()]*)>)?\s*\(")
DECLARATION = re.compile(
    r"^(?:const\s+)?(?:uint32_t|int|int64_t|float\*)\s+(\w+)\s*=\s*(.+)$", re.S
)


def walk_block(nodes: list, walk: Walk) -> None:
    for node in nodes:
        if walk.returned:
            return
        if node[0] == "if" and node[1] == "b.m_count==0" and node[3] == ("simple", "return"):
            walk.guard = Guard.HAS_WORK  # the rest runs only for a CTA with work
            continue
        walk_node(node, walk)


def walk_node(node, walk: Walk) -> None:
    match node:
        case ("block", nodes):
            inner = walk.fork()
            walk_block(nodes, inner)
            walk.calls += inner.calls
            walk.returned = inner.returned
        case ("simple", text):
            walk_simple(text, walk)
        case ("if", cond, constexpr, then, other):
            walk_if(cond, constexpr, then, other, walk)
        case ("while", cond, body):
            walk_simple(cond, walk)
            walk_node(body, walk)
        case ("for", "inti=0;i<b.m_count;++i" | "inti=i_first;i<b.m_count;++i", body):
            # `peel_dead on`: the lagged consumer's loop starts after the peeled m-block, where
            # there is one (the producer's and the writers' loops run every m-block)
            lagged = walk.source is CodeSite.CONSUMER_LAGGED
            assert not (
                lagged and walk.params.peel_dead and "i=0;" in node[1]
            ), "m-block 0 run twice"
            inner = walk.fork(phase=LoopPhase.LOOP)
            walk_node(body, inner)
            walk.calls += inner.calls
            walk.phase = LoopPhase.AFTER
        case ("for", head, body) if "panel<Cfg::kPanels" in head:
            for _ in range(walk.env["kPanels"]):
                walk_node(body, walk)
        case ("for", "intbuf=0;buf<2;++buf", body):  # `dq_lag on`: dS^T's barriers per buffer
            inner = walk.fork()
            inner.variables["buf"] = "(run.m0+i)%2"
            walk_node(body, inner)
            walk.calls += inner.calls
        case ("for", head, body) if "slot<Cfg::kStages" in head or "slot<Cfg::kDoStages" in head:
            inner = walk.fork()
            ring = "kDoStages" if "kDoStages" in head else "kStages"
            # each slot: the ring's barriers (every slot, whichever m-block runs it)
            inner.variables["slot"] = f"(run.m0+i)%Cfg::{ring}"
            walk_node(body, inner)
            walk.calls += inner.calls
        case ("for", head, body):
            inner = walk.fork()
            walk_node(body, inner)
            assert not inner.calls, f"a loop the check does not know: for ({head})"


def walk_if(cond: str, constexpr: bool, then, other, walk: Walk) -> None:
    flags = {"Cfg::kDqByKeys": walk.params.dq_by_keys}
    flags["Cfg::kDqByQueries"] = walk.params.dq_by_queries
    flags["Cfg::kDqTransposed"] = walk.params.dq_transposed
    flags["Cfg::kDeterministic"] = walk.params.deterministic
    flags["Cfg::kOverlap"] = walk.params.overlap
    flags["Cfg::kEarlyDv"] = walk.params.early_dv
    flags["Cfg::kDvBeforeMeeting"] = walk.params.dv_before_meeting
    flags["Cfg::kDqRed"] = walk.params.dq_red
    flags["Cfg::kDqWriter"] = walk.params.dq_writer
    flags["Cfg::kDsStmatrix"] = walk.params.ds_stmatrix
    flags["Cfg::kSplitHeadDim"] = walk.params.split
    flags["Cfg::kPersistent"] = walk.params.persistent
    flags["Cfg::kDqLag"] = walk.params.dq_lag
    flags["Cfg::kDqFirst"] = walk.params.dq_first
    flags["Cfg::kDkvTma"] = walk.params.dkv_tma
    flags["Cfg::kPrefetchKv"] = walk.params.prefetch_kv
    flags["Cfg::kDvOutFirst"] = walk.params.dv_out_first
    flags["Cfg::kPeelDead"] = walk.params.peel_dead
    flags["Cfg::kLateV"] = walk.params.late_v
    flags |= {f"!{name}": not value for name, value in flags.items()}
    if constexpr:  # a flag, its negation, or a conjunction of them
        chosen = then if all(flags[part] for part in cond.split("&&")) else other
        if chosen is not None:
            walk_node(chosen, walk)
        return
    changes = {
        "tid==0": dict(who=Who.LEADER),
        "threadIdx.x==0": dict(who=Who.THREAD0),
        "b.m_count>0": dict(guard=Guard.HAS_WORK),
        # the owed ticket's release: from m-block 1 on, and after a loop with work
        "tid==0&&i>0": dict(who=Who.LEADER, guard=Guard.OWED),
        "tid==0&&b.m_count>0": dict(who=Who.LEADER, guard=Guard.OWED),
        # reduce_dq's writer branch and bwd_dq_writer: the empty barrier's sync from m-block
        # 1 on and its arrival but in the last m-block; the writer's lane 0
        "i>0": dict(guard=Guard.AFTER_FIRST),
        "i+1<b.m_count": dict(guard=Guard.BEFORE_LAST),
        "lane==0": dict(who=Who.WRITER_LANE0),
        # `dq_lag on`: the store into a dS^T buffer's waits for its previous use's readers
        "run_i>=2": dict(guard=Guard.REUSED),
        # `late_v on`: V's load in the producer's m-block 0, its wait in a warpgroup's first
        # pass of the loop (m-block 1 after a peeled m-block 0)
        "i==0": dict(guard=Guard.FIRST),
        "i==i_first": dict(guard=Guard.FIRST),
    }
    if cond == "P.dkv_store==kDkvStoreT":  # dK and dV by TMA, then return; under GQA (fp32
        # sums per K/V head) the st.global from registers after it, which no sync orders;
        # `dv_out_first on`: dV's by TMA first, before the last dQ (no return there)
        assert other is None
        inner = walk.fork()
        walk_node(then, inner)
        walk.calls += inner.calls
        walk.returned = then[-1][-1] == ("simple", "return")
        assert (
            walk.returned or walk.params.dv_out_first
        ), "a return ends it (dv_out_first's dV: none)"
        return
    if cond == "bwd_first_block_dead<Cfg>(P,b,wg)":  # `peel_dead on`: the peeled m-block
        assert other is None and walk.phase is LoopPhase.BEFORE
        inner = walk.fork(phase=LoopPhase.PEELED)
        walk_node(then, inner)
        walk.calls += inner.calls
        return
    if cond == "i>0" and other is not None:  # `dq_lag on`: dQ(i - 1) around dK(i)'s calls
        return _walk_lagged(then, other, walk)
    if cond == "b.m_count>0" and walk.phase is LoopPhase.AFTER and _declares_last(then):
        inner = walk.fork(guard=Guard.LAGGED)  # the last m-block's lagged dQ
        walk_node(then, inner)
        walk.calls += inner.calls
        return
    if cond == "i>0" and walk.guard is Guard.LAGGED:  # reduce_dq's writer branch, lagged:
        # its i is the m-block the call acts for (i - 1 in the loop, the last after it), so
        # its test keeps the lag and leaves out that call's first m-block
        assert walk.variables.get("i") in ("i-1", "b.m_count-1"), walk.variables.get("i")
        inner = walk.fork(guard=Guard.LAGGED_AFTER_FIRST)
        walk_node(then, inner)
        walk.calls += inner.calls
        return
    if cond in changes:
        assert other is None, cond
        inner = walk.fork(**changes[cond])
        walk_node(then, inner)
        walk.calls += inner.calls
        return
    sides = []
    for side in (then, other):
        inner = walk.fork()
        if side is not None:
            walk_node(side, inner)
        sides.append(inner.calls)
    assert sides[0] == sides[1], f"calls that depend on a condition the check does not know: {cond}"
    walk.calls += sides[0]


def _declares_last(node) -> bool:
    """A block whose first statement declares `last`, the m-block its calls act for."""
    first = node[1][0] if node[0] == "block" and node[1] else ("", "")
    return first[0] == "simple" and squash(first[1]).startswith("constintlast=")


def _walk_lagged(then, other, walk: Walk) -> None:
    """`if (i > 0) { A } else { B }` in bwd_consumer_lagged: B's calls (dK's; with
    `dq_first on` the fence, dV's and dK's) are A's too, in the same order (A's first match of
    each, in turn); A's others act for m-block i - 1 (``Guard.LAGGED``), B's run in every
    m-block."""
    lagged, unlagged, plain = walk.fork(guard=Guard.LAGGED), walk.fork(), walk.fork()
    walk_node(then, lagged)  # A's calls read as m-block i - 1's
    walk_node(then, unlagged)  # A's calls read as m-block i's
    walk_node(other, plain)
    at, matched = 0, {}
    for call in plain.calls:
        rest = unlagged.calls[at:]
        assert (
            call in rest
        ), "the else branch's calls are not the lagged branch's: the check does not know it"
        at += rest.index(call)
        matched[at], at = call, at + 1
    walk.calls += [matched.get(n, call) for n, call in enumerate(lagged.calls)]


def walk_simple(text: str, walk: Walk) -> None:
    declared = DECLARATION.match(text.strip())
    for found in CALL.finditer(text):
        name, template = found[1], found[2] or ""
        args = split_args(group(text, found.end() - 1))
        if name in INLINED:
            params, body = function(walk.header, rf"void {name}\(")
            inner = walk.fork(source=INLINED[name])
            params = split_args(params)
            assert len(args) <= len(params), name  # (the rest: default arguments)
            for param, arg in zip(params, args):
                value = expand(arg, walk.variables)
                if value != param_name(param):  # the same name: nothing to resolve
                    inner.variables[param_name(param)] = value
            walk_block(statements(body), inner)
            walk.calls += inner.calls
        elif name in TRACED:
            detail = detail_of(name, args, template, walk)
            call = Call(TRACED[name], walk.who, walk.phase, walk.guard, walk.source, detail)
            walk.calls.append(call)
    if declared:
        walk.variables[declared[1]] = split_args(declared[2])[0]
