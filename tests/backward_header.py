"""What the backward header does, call by call, as the protocol's items would say it: the
reader behind tests/test_verify_backward_header.py's check that emit/sm90/include/fadsl/sm90_bwd_producer.cuh
(bwd_producer), emit/sm90/include/fadsl/sm90_bwd_dq_reduce.cuh (reduce_dq, ordered_reduce_add,
release_dq_ticket), emit/sm90/include/fadsl/sm90_bwd_consumer.cuh (bwd_consumer, meet_and_issue_dq)
and the kernel body of emit/sm90/backward.cu.j2 make exactly the calls of
fadsl/targets/sm90/backward/protocol.py (the plan the sync pass places).

The header's C++ is read by tests/cpp_reader.py (statements, blocks, if / if constexpr /
for / while) and walked by tests/backward_walk.py. The walk takes a function for one configuration (if constexpr on kDqByKeys and kDeterministic
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
from pathlib import Path

from fadsl.targets.sm90.backward import emit
from fadsl.targets.sm90.backward.program import (
    StagedTile,
    Kind,
    Params,
    Part,
    Protocol,
    WarpRole,
    CodeSite,
    Who,
    bar_id,
)

from fadsl.targets.sm90.backward.protocol import protocol

from backward_walk import Call, Walk, evaluate, walk_block
from cpp_reader import function, group, squash, statements, strip

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


def kernel_template(
    overlap: bool,
    template: str = TEMPLATE,
    split: bool = False,
    persistent: bool = False,
    dq_lag: bool = False,
    late_v: bool = False,
) -> str:
    """The template with each `{% if overlap %} A {% else %} B {% endif %}` (and `{% if split
    %}`, `persistent`, `dq_lag`, `late_v`; `fused_convert` off) decided, the roles' functions named as emit.py names them, and
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
        if flag == "dq_lag":  # (`late_v`'s Cfg constant goes with the others, below)
            init = tag("if late_v") + r"(\s*mbar_init.*?)" + tag("endif")
            decided = re.sub(init, lambda b: b[1] if late_v else "", decided, flags=re.S)
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
            "if (window|softcap|longest_first|varlen|dv_before_meeting|dq_writer|dq_chains > 1|ds_stmatrix|dkv_tma|prefetch_kv|dv_out_first|peel_dead|late_v|modifiers|score|score_by_distance|score_grad|keep|keep_classes|learn|persistent or dq_lag|dq_first)"
        )
        + r"(.*?)"
        + tag("endif"),
        re.S,
    )
    for block in constants.finditer(decided):
        body = re.sub(r"//[^\n]*", "", block[2])
        if block[1] in ("learn", "keep_classes"):  # a kernel of its own, after or before the main
            body = re.sub(
                r'extern "C" __global__ [^\n]*_(learn|keep_classes)\([^)]*\) \{[^}]*\}', "", body
            )
        assert "(" not in body, f"a call under {{% if {block[1]} %}}"
    decided = constants.sub("", decided)
    assert not re.search(tag(r"(if|elif|else|endif)\b.*?"), decided), "another {% if %}"
    return decided


def config_constants(params: Params) -> dict[str, object]:
    """BwdConfig's static constexpr values for ``params``, evaluated from the header."""
    text = strip(HEADER)
    at = text.index("struct BwdConfig")
    body = group(text, text.index("{", at), "{", "}")
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
            params.overlap, template, params.split, params.persistent, params.dq_lag, params.late_v
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
    if buffer in (StagedTile.K, StagedTile.V):  # dK's and dV's rows, for their TMA stores
        return "stage_grad_kv"
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
            case Kind.LOAD_ROWS:
                detail = (frozenset(smem(x.reads)),)
            case Kind.PACK:
                detail = (x.reg_reads, x.reg_writes)
            case Kind.ST_SHARED:
                store = store_function(x.writes[0].buffer, p)
                detail = (smem(x.writes)[0], x.reg_reads[0], store)
            case Kind.BULK_REDUCE_ADD | Kind.TMA_STORE:
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


def lag_edits_missed(old: str, new: str, cases) -> list[int]:
    """The occurrences n (from 0) of ``old`` in LAG_HEADER whose replacement by ``new``
    leaves bwd_consumer_lagged's calls equal to the proven plan's in every configuration of
    ``cases`` (an edit the check would not catch)."""
    missed = []
    for n in range(LAG_HEADER.count(old)):
        at = -1
        for _ in range(n + 1):
            at = LAG_HEADER.index(old, at + 1)
        edited = LAG_HEADER[:at] + new + LAG_HEADER[at + len(old) :]
        if all(
            header_calls(WarpRole.CONSUMER, p, lag_header=edited)
            == expected_calls(protocol(p), WarpRole.CONSUMER)
            for p in cases
        ):
            missed.append(n)
    return missed
