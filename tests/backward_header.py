"""What the backward header does, call by call, as the protocol's items would say it: the
reader behind tests/test_verify_backward_header.py's check that emit/sm90/include/fadsl/sm90_bwd_producer.cuh
(bwd_producer), emit/sm90/include/fadsl/sm90_bwd_dq_reduce.cuh (reduce_dq, ordered_reduce_add,
release_dq_ticket), emit/sm90/include/fadsl/sm90_bwd_consumer.cuh (bwd_consumer, meet_and_issue_dq)
and the kernel body of emit/sm90/backward.cu.j2 make exactly the calls of
fadsl/targets/sm90/backward/protocol.py (the plan the sync pass places).

A small reader of the header's C++: statements, blocks, if / if constexpr / for / while.
It walks a function for one configuration (if constexpr on kDqByKeys and kDeterministic
decided; the panel loop unrolled; the m-block loop marks its items LOOP and those after
it AFTER; `if (tid == 0)` makes the leader the executor; `if (b.m_count > 0)` and an early
`return` when m_count == 0 guard the items, `if (tid == 0 && i > 0)` and, after the loop,
`if (tid == 0 && b.m_count > 0)` the owed ticket's release; ordered_reduce_add,
release_dq_ticket, reduce_dq and meet_and_issue_dq inlined with their parameters bound), and turns each traced call into a
Call, resolving the operands' local variables down to the SMEM offsets (kOff*) and the ring
index and parity expressions. Any other condition must have the same calls on both sides.
The consumer's function is the one the template's kernel body calls, with its
`{% if overlap %}` decided (``kernel_template``). At head_dim 256 the roles' functions are
emit/sm90/include/fadsl/sm90_bwd_split.cuh's (bwd_producer_split, bwd_consumer_split), which
the template names through emit.py's slots; operands of the warpgroup's head_dim panels
(2 wg + n) are read by evaluating their offsets.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace
from pathlib import Path

from fadsl.targets.sm90.backward import emit
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
    Protocol,
    Reg,
    WarpRole,
    CodeSite,
    Who,
    bar_id,
)

ROOT = Path(__file__).resolve().parents[1]
# sm90_bwd.cuh with the sections it includes (the roles' functions live in sm90_bwd_producer.cuh,
# sm90_bwd_dq_reduce.cuh and sm90_bwd_consumer.cuh), in its include order
HEADER = "".join(
    (ROOT / "emit/sm90/include/fadsl" / name).read_text()
    for name in (
        "sm90_bwd.cuh",
        "sm90_bwd_block.cuh",
        "sm90_bwd_ds.cuh",
        "sm90_bwd_persistent.cuh",
        "sm90_bwd_producer.cuh",
        "sm90_bwd_dq_reduce.cuh",
        "sm90_bwd_consumer.cuh",
        "sm90_bwd_writer.cuh",
        "sm90_bwd_prep.cuh",
    )
)
SPLIT_HEADER = (ROOT / f"emit/sm90/include/fadsl/{emit.SPLIT_HEADER}").read_text()
# `dq_lag on`'s consumer (bwd_consumer_lagged, issue_dq_lagged), a section sm90_bwd.cuh
# includes; read apart, so that an edit of HEADER's text names one place
LAG_HEADER = (ROOT / "emit/sm90/include/fadsl/sm90_bwd_lag.cuh").read_text()
TEMPLATE = (ROOT / "emit/sm90/backward.cu.j2").read_text()
# the functions a role's walk inlines, with the source their calls are tagged with
INLINED = {
    "ordered_reduce_add": CodeSite.ORDERED_REDUCE_ADD,
    "reduce_dq": CodeSite.REDUCE_DQ,
    "meet_and_issue_dq": CodeSite.MEET_AND_ISSUE_DQ,
    "bwd_load_kv": CodeSite.LOAD_KV,
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
    "pack_pairs": Kind.PACK,
    "store_ds": Kind.ST_SHARED,
    "store_ds_t": Kind.ST_SHARED,
    "store_ds_stmatrix": Kind.ST_SHARED,
    "store_keys_t": Kind.ST_SHARED,
    "stage_dq": Kind.ST_SHARED,
    "bulk_reduce_add_f32": Kind.BULK_REDUCE_ADD,
    "red_add_dq": Kind.RED_GLOBAL,
    "store_grad_kv": Kind.STORE_GLOBAL,
    "store_grad_kv_t": Kind.STORE_GLOBAL,
}
# the callees whose operands name SMEM, by argument position
SMEM_ARGS = {"issue_keys_by_rows": (1, 2), "issue_grad_kv": (2,), "issue_dq": (1, 2)}
SMEM_ARGS |= {"issue_dq_t": (1, 2), "store_ds_t": (0,)}
SMEM_ARGS |= {"bwd_probs": (3,), "bwd_grad_scores": (3,), "store_ds": (0,), "stage_dq": (0,)}
SMEM_ARGS |= {"bulk_reduce_add_f32": (1,), "tma_load_4d": (0,), "bulk_load": (0,)}
SMEM_ARGS |= {"issue_rows_by_keys": (1, 2), "issue_grad_panel_t": (1, 2)}
SMEM_ARGS |= {"issue_dq_panel_t": (1, 2), "bwd_probs_rows": (3,), "bwd_grad_scores_rows": (3,)}
SMEM_ARGS |= {"store_keys_t": (0,), "store_ds_stmatrix": (0,)}
REGISTERS = {"s": Reg.S, "dp": Reg.DP, "p16": Reg.P16, "ds16": Reg.DS16}
REGISTERS |= {"dk": Reg.DK, "dv": Reg.DV, "dq": Reg.DQ}
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
# head_dim 256: a 64-column panel of K (B_c rows) or of a Q or dO slot (B_r rows)
PANEL_BYTES = {StagedTile.K: "kBlockN*kRowBytes", StagedTile.Q: "kBlockM*kRowBytes"}
PANEL_BYTES |= {StagedTile.DO: "kBlockM*kRowBytes"}


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _strip(text: str) -> str:
    text = re.sub(r"\{([%#]).*?\1\}", "", text, flags=re.S)  # the template's jinja tags
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line for line in text.split("\n") if not line.strip().startswith("#"))


def kernel_template(
    overlap: bool,
    template: str = TEMPLATE,
    split: bool = False,
    persistent: bool = False,
    dq_lag: bool = False,
) -> str:
    """The template with each `{% if overlap %} A {% else %} B {% endif %}` (and `{% if split
    %}`, `persistent`, `dq_lag`; `fused_convert` off) decided, the roles' functions named as emit.py names them, and
    the Cfg's window, softcap and modifier constants (and the modifiers' struct, included from
    a template of its own; the barrier count of `persistent or dq_lag`) left out (no other
    `{% if %}` may decide which calls the kernel makes)."""
    tag = lambda body: rf"\{{%-?\s*{body}\s*-?%\}}"  # noqa: E731
    decided = template
    flags = (("overlap", overlap), ("split", split), ("persistent", persistent))
    # (`fused_convert`'s bwd_finish_dq runs after the roles' programs, and its Cfg constant:
    # read against the plan of its own, finish.py, by tests/test_backward_fused_convert.py;
    # decided first, since its blocks sit inside `persistent`'s branches)
    for flag, value in (("fused_convert", False),) + flags + (("dq_lag", dq_lag),):
        branch = re.compile(
            tag(f"if {flag}") + r"(.*?)(?:" + tag("else") + r"(.*?))?" + tag("endif"), re.S
        )
        decided = branch.sub(lambda b: (b[1] if value else b[2]) or "", decided)
    names = {
        "header": emit.SPLIT_HEADER if split else emit.HEADER,
        "producer": emit.SPLIT_PRODUCER if split else emit.PRODUCER,
        "consumer": (
            emit.SPLIT_CONSUMER if split else emit.LAGGED_CONSUMER if dq_lag else emit.CONSUMER
        ),
    }
    for slot, name in names.items():
        decided = re.sub(r"\{\{\s*" + slot + r"\s*\}\}", name, decided)
    # the Cfg's constants of a window or a softcap: declarations, never calls
    constants = re.compile(
        tag(
            "if (window|softcap|longest_first|varlen|dv_before_meeting|dq_writer|ds_stmatrix|modifiers|score|score_grad|keep|learn|persistent or dq_lag|dq_first)"
        )
        + r"(.*?)"
        + tag("endif"),
        re.S,
    )
    for block in constants.finditer(decided):
        body = re.sub(r"//[^\n]*", "", block[2])
        if block[1] == "learn":  # a learnable variant's `_learn` kernel: of its own, after the main
            body = re.sub(r'extern "C" __global__ [^\n]*_learn\([^)]*\) \{[^}]*\}', "", body)
        assert "(" not in body, f"a call under {{% if {block[1]} %}}"
    decided = constants.sub("", decided)
    assert not re.search(tag(r"(if|elif|else|endif)\b.*?"), decided), "another {% if %}"
    return decided


def param_name(param: str) -> str:
    """The name a C++ parameter declares: `const float (&dq)[N]` -> dq, `int* p` -> p."""
    return re.findall(r"\w+", re.sub(r"\[[^\]]*\]", "", param))[-1]


def function(text: str, pattern: str) -> tuple[str, str]:
    """(parameters, body) of the first function whose head matches ``pattern``."""
    text = _strip(text)
    head = re.search(pattern, text)
    assert head, pattern
    params_at = text.index("(", head.end() - 1)
    params = _group(text, params_at)
    at = text.index("{", params_at + len(params) + 2)
    return params, _group(text, at, "{", "}")


def _group(text: str, at: int, open_: str = "(", close: str = ")") -> str:
    """The text inside the balanced delimiters that open at ``at``."""
    assert text[at] == open_, text[at : at + 40]
    depth = 0
    for n in range(at, len(text)):
        depth += {open_: 1, close: -1}.get(text[n], 0)
        if depth == 0:
            return text[at + 1 : n]
    raise AssertionError("unbalanced")


def statements(text: str) -> list:
    """The statements of a block: ('block', [...]), ('if', cond, constexpr, then, other),
    ('for', head, body), ('while', cond, body) or ('simple', text)."""
    out, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return out
        node, at = _statement(text, at)
        out.append(node)


def _statement(text: str, at: int):
    while text[at].isspace():
        at += 1
    rest = text[at:]
    if rest.startswith("{"):
        inner = _group(text, at, "{", "}")
        return ("block", statements(inner)), at + len(inner) + 2
    word = re.match(r"(if|for|while)\b\s*(constexpr\b)?\s*", rest)
    if word:
        at += word.end()
        cond = _group(text, at)
        body, at = _statement(text, at + len(cond) + 2)
        if word[1] != "if":
            return (word[1], squash(cond), body), at
        other = re.match(r"\s*else\b", text[at:])
        if not other:
            return ("if", squash(cond), bool(word[2]), body, None), at
        other_body, end = _statement(text, at + other.end())
        return ("if", squash(cond), bool(word[2]), body, other_body), end
    depth, n = 0, at
    while not (text[n] == ";" and depth == 0):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[n], 0)
        n += 1
    return ("simple", text[at:n]), n + 1


def split_args(text: str) -> list[str]:
    args, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += ch
    return args + ([current.strip()] if current.strip() else [])


def config_constants(params: Params) -> dict[str, object]:
    """BwdConfig's static constexpr values for ``params``, evaluated from the header."""
    text = _strip(HEADER)
    at = text.index("struct BwdConfig")
    body = _group(text, text.index("{", at), "{", "}")
    # template parameters the protocol does not know take their defaults
    head = text[text.rindex("template", 0, at) : at]
    env: dict[str, object] = {
        name: evaluate(value, {}) for name, value in re.findall(r"(\w+_)\s*=\s*(\w+)", head)
    }
    env |= {"kHeadDim_": params.head_dim, "kBlockM_": params.block_m}
    env |= {"kBlockN_": params.block_n, "kConsumerWGs_": params.consumers}
    env |= {"kStages_": params.stages, "kCausal_": False, "kDeterministic_": params.deterministic}
    env |= {"kOverlap_": params.overlap, "kEarlyDv_": params.early_dv, "kDqRed_": params.dq_red}
    for name, expr in re.findall(r"static constexpr (?:int|bool) (\w+) = ([^;]+);", body):
        env[name] = evaluate(expr, env)
    return env


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
    header: str = HEADER  # the text the inlined functions are read from
    phase: LoopPhase = LoopPhase.BEFORE
    guard: Guard = Guard.ALWAYS

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


def operand(expr: str, walk: Walk) -> tuple:
    flat = expand(expr, walk.variables)
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
    smem = [operand(args[n], walk) for n in SMEM_ARGS.get(name, ())]
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
        case Kind.PROBS | Kind.GRAD_SCORES:
            regs = tuple(REGISTERS[a] for a in args if a in REGISTERS)
            return frozenset(op[:2] for op in smem), regs
        case Kind.PACK:
            return (REGISTERS[args[0]],), (REGISTERS[args[1]],)
        case Kind.ST_SHARED:  # (which store: st.shared, stmatrix or stmatrix .trans)
            return smem[0][:2], REGISTERS[args[1]], name
        case Kind.BULK_REDUCE_ADD:
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
        case ("simple", text):
            walk_simple(text, walk)
        case ("if", cond, constexpr, then, other):
            walk_if(cond, constexpr, then, other, walk)
        case ("while", cond, body):
            walk_simple(cond, walk)
            walk_node(body, walk)
        case ("for", "inti=0;i<b.m_count;++i", body):
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
    }
    if cond == "i>0" and other is not None:  # `dq_lag on`: dQ(i - 1) around dK(i)'s calls
        return _walk_lagged(then, other, walk)
    if cond == "b.m_count>0" and walk.phase is LoopPhase.AFTER and _declares_last(then):
        inner = walk.fork(guard=Guard.LAGGED)  # the last m-block's lagged dQ
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
        args = split_args(_group(text, found.end() - 1))
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


KERNEL = r"__global__ void __launch_bounds__\(Cfg::kThreads"
SOURCES = {"bwd_consumer": CodeSite.CONSUMER, "bwd_consumer_split": CodeSite.CONSUMER_SPLIT}
SOURCES |= {"bwd_consumer_lagged": CodeSite.CONSUMER_LAGGED}
SOURCES |= {"bwd_producer": CodeSite.PRODUCER, "bwd_producer_split": CodeSite.PRODUCER_SPLIT}
WRITERS = "bwd_dq_writers"  # the producer warpgroup's call of `dq_writer on`'s writer warps


def kernel_body(
    overlap: bool,
    template: str = TEMPLATE,
    split: bool = False,
    persistent: bool = False,
    dq_lag: bool = False,
) -> str:
    """The main kernel's body in the template, `{% if overlap %}` decided."""
    return function(kernel_template(overlap, template, split, persistent, dq_lag), KERNEL)[1]


def consumer_function(
    overlap: bool,
    template: str = TEMPLATE,
    split: bool = False,
    persistent: bool = False,
    dq_lag: bool = False,
) -> str:
    """The consumer body the kernel calls: `else { ...; NAME<Cfg>(P, smem, block,
    warpgroup - 1); }` after the producer's branch (`scheduler persistent`: per tile, with
    the tile's BwdRun last)."""
    body = squash(kernel_body(overlap, template, split, persistent, dq_lag))
    run = ",run" if persistent else ""
    (name,) = re.findall(rf"(\w+)<Cfg>\(P,smem,block,warpgroup-1{run}\);", body)
    return name


def producer_function(
    overlap: bool, template: str = TEMPLATE, split: bool = False, persistent: bool = False
) -> str:
    """The producer body the kernel's elected thread calls: `NAME<Cfg>(P, smem, block);`
    (`scheduler persistent`: `NAME<Cfg>(P, smem, block, run);` per tile)."""
    body = squash(kernel_body(overlap, template, split, persistent))
    run = ",run" if persistent else ""
    (name,) = re.findall(rf"(\w+)<Cfg>\(P,smem,block{run}\);", body)
    return name


def writer_function(overlap: bool, template: str = TEMPLATE, split: bool = False) -> str:
    """The writer body the producer warpgroup's warps run: the kernel calls `bwd_dq_writers<Cfg>(P,
    smem, shared);` in warpgroup 0's branch, which calls it under `if constexpr
    (Cfg::kDqWriter)`."""
    body = squash(kernel_body(overlap, template, split))
    assert f"setmaxnreg_dec<Cfg::kProducerRegs>();" in body.split(f"{WRITERS}<Cfg>")[0]
    assert body.count(f"{WRITERS}<Cfg>(P,smem,shared);") == 1, "the writers' call"
    _, dispatch = function(HEADER, rf"void {WRITERS}\(")
    (name,) = re.findall(r"(\w+)<Cfg>\(P,smem,bwd_role_block", squash(dispatch))
    assert squash(dispatch).startswith("ifconstexpr(Cfg::kDqWriter)"), dispatch
    return name


def header_calls(
    role: WarpRole,
    params: Params,
    header: str = HEADER,
    template: str = TEMPLATE,
    split_header: str = SPLIT_HEADER,
    lag_header: str = LAG_HEADER,
) -> list[Call]:
    """The calls of ``role``'s function for ``params``: the producer's and the consumer's
    in the headers (each the one the template's kernel calls), the setup's in the
    template's kernel body."""
    headers = header + split_header + lag_header
    if role is WarpRole.SETUP:
        text = kernel_template(
            params.overlap, template, params.split, params.persistent, params.dq_lag
        )
        pattern, source, who = KERNEL, CodeSite.KERNEL, Who.CTA
    elif role is WarpRole.CONSUMER:
        name = consumer_function(
            params.overlap, template, params.split, params.persistent, params.dq_lag
        )
        text = headers
        pattern, source, who = rf"void {name}\(", SOURCES[name], Who.WARPGROUP
    elif role is WarpRole.WRITER:
        name = writer_function(params.overlap, template, params.split)
        if not params.dq_writer:  # bwd_dq_writers' if constexpr: no call
            return []
        text, pattern, source, who = headers, rf"void {name}\(", CodeSite.DQ_WRITER, Who.WRITER
    else:
        name = producer_function(params.overlap, template, params.split, params.persistent)
        text = headers
        pattern, source, who = rf"void {name}\(", SOURCES[name], Who.ELECTED
    _, body = function(text, pattern)
    walk = Walk(params, config_constants(params), source, who, {}, [], headers)
    walk_block(statements(body), walk)
    return walk.calls


def store_function(buffer: StagedTile, p: Params) -> str:
    """The header's function that stores ``buffer`` from registers in configuration ``p``:
    dQ's staging, P and dS at head_dim 256 (stmatrix .trans, the keys as rows), dS^T by
    stmatrix .trans where dQ is transposed, else by stmatrix or st.shared as the spec says."""
    if buffer is StagedTile.DQ_STAGE:
        return "stage_dq"
    if p.split:
        return "store_keys_t"
    if p.dq_transposed:
        return "store_ds_t"
    return "store_ds_stmatrix" if p.ds_stmatrix else "store_ds"


def expected_calls(proto: Protocol, role: WarpRole) -> list[Call]:
    """The protocol's items as the header's calls (the register-only zeroing has none)."""
    p = proto.params
    out = []
    for x in proto.role(role):
        smem = lambda ops: tuple((op.buffer, op.index) for op in ops)  # noqa: E731
        match x.kind:
            case Kind.ZERO:
                continue
            case Kind.MBAR_INIT:
                detail = (x.mbar, x.slot, x.count)
            case Kind.MBAR_WAIT:
                detail = (x.mbar, x.slot, x.parity)
            case Kind.MBAR_ARRIVE:
                detail = (x.mbar, x.slot)
            case Kind.MBAR_ARRIVE_EXPECT_TX:
                detail = (x.mbar, x.slot, x.tx)
            case Kind.WGMMA_WAIT | Kind.BULK_WAIT_READ | Kind.BULK_WAIT:
                detail = (x.pending,)
            case Kind.NAMED_BAR_SYNC | Kind.NAMED_BAR_ARRIVE:
                detail = (tuple(bar_id(x.named, wg) for wg in range(p.consumers)), x.threads)
            case Kind.TMA_LOAD | Kind.BULK_LOAD:
                detail = (x.mbar, x.slot) + smem(x.writes)[0]
            case Kind.WGMMA:  # (head_dim 256: which of the warpgroup's panels)
                ops = frozenset(
                    (op.buffer, op.index, op.part)
                    + ((op.panel,) if op.part is Part.WG_PANEL else ())
                    for op in x.reads
                )
                detail = (x.reg_writes[0], ops)
            case Kind.PROBS | Kind.GRAD_SCORES:
                regs = tuple(dict.fromkeys(x.reg_reads + x.reg_writes))
                detail = (frozenset(smem(x.reads)), regs)
            case Kind.PACK:
                detail = (x.reg_reads, x.reg_writes)
            case Kind.ST_SHARED:
                store = store_function(x.writes[0].buffer, p)
                detail = (smem(x.writes)[0], x.reg_reads[0], store)
            case Kind.BULK_REDUCE_ADD:
                detail = (x.reads[0].buffer,)
            case Kind.STORE_GLOBAL | Kind.RED_GLOBAL:
                detail = x.reg_reads
            case _:
                detail = ()
        out.append(Call(x.kind, x.who, x.phase, x.guard, x.source, detail))
    return out


def differences(expected: list[Call], found: list[Call]) -> str:
    show = lambda calls: [
        f"{c.phase.name} {c.who.name} {c.kind.value} {c.detail}" for c in calls
    ]  # noqa
    return "\n".join(
        difflib.unified_diff(show(expected), show(found), "protocol", "header", lineterm="")
    )
