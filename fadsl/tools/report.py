"""Text for people and tools: the IR printer, `fadsl check`'s summary and `fadsl explain`."""

from __future__ import annotations

from typing import Any

from ..build.spill_check import RegisterCheck, register_cap
from ..ir import Kernel, Phase, Step
from ..ir.expr import Modifiers, text
from ..passes.plan_smem import flow, live_text, occupancy
from ..pipeline import Compiled
from ..build.resources import ctas_per_sm


def summary(compiled: Compiled, registers: RegisterCheck | None = None) -> str:
    """`fadsl check`: the configuration in a few lines, and what the compiler said."""
    k = compiled.kernel
    cfg = k.config
    rows = cfg.block_r // cfg.warps
    order = ", ".join(s.op.loop_text or s.op.spelling for s in k.mainloop if isinstance(s, Step))
    lines = [
        ("kernel", f"{cfg.name} (target {cfg.target})"),
        ("dtypes", f"{', '.join(d.value for d in cfg.dtypes)} (fp32 softmax and accumulators)"),
        ("tiles", f"B_r = {cfg.block_r}, B_c = {cfg.block_c}, head_dim = {cfg.head_dim}"),
        ("warps", f"{cfg.warps} ({cfg.threads} threads; {rows} query rows per warp)"),
        ("mask", cfg.mask_text),
        ("swizzle", f"{cfg.swizzle or 'none'}"),
        ("smem", f"{k.smem_bytes} bytes ({cfg.smem_alias.value} aliasing)"),
    ]
    lines += [(t.role.value, t.path_text()) for t in k.tensors]
    lines.append(("mainloop", order))
    report = compiled.target.report
    if report is not None:
        lines = report.check_lines(k, lines)
    if k.backward is not None:
        lines.append(("backward", _backward_line(k)))
    m = cfg.modifiers
    if m is not None:
        lines += [("input", i.text()) for i in m.inputs]
        lines += [
            (key, text(e)) for key, e in (("score", m.score), ("keep", m.keep)) if e is not None
        ]
    if registers is not None:
        cap, why = _register_cap(compiled)
        lines.append(("registers", _registers_line(registers, cap, why)))
    return f"{compiled.file}: ok\n" + "".join(f"  {key:<10}{value}\n" for key, value in lines)


def _backward_line(kernel: Kernel) -> str:
    b = kernel.backward
    return (
        f"B_r = {b.block_m}, B_c = {b.block_n}, {b.consumers} consumer warpgroups, setmaxnreg "
        f"{b.producer_regs}/{b.consumer_regs}, stages {b.stages}, deterministic "
        f"{'on' if b.deterministic else 'off'}, overlap {'on' if b.overlap else 'off'}"
        + (", early_dv on" if b.early_dv else "")
        + (", longest_first on" if b.longest_first else "")
        + (", dq_writer on" if b.dq_writer else "")
        + (f", dq_chains {b.dq_chains}" if b.dq_chains != 1 else "")
        + (", dS by stmatrix" if b.ds_stmatrix else "")
        + (", prefetch_kv on" if b.prefetch_kv else "")
        + (", dv_out_first on" if b.dv_out_first else "")
        + (", peel_dead on" if b.peel_dead else "")
        + (", late_v on" if b.late_v else "")
        + " (the spec's backward block; explain shows its plan)"
    )


def _register_cap(compiled: Compiled) -> tuple[int, str]:
    """The registers per thread to compare the compiler's count with, and why (or '')."""
    report = compiled.target.report
    if report is not None:
        return report.register_cap(compiled.kernel, compiled.target.capabilities)
    return register_cap(compiled.target.capabilities, compiled.kernel.config.threads), ""


def _registers_line(check: RegisterCheck, cap: int, why: str = "") -> str:
    if not check.ran:
        return f"not checked ({check.compiler})"
    per_dtype: dict[str, list[str]] = {}
    for row in check.rows:
        per_dtype.setdefault(row.dtype.value, []).append(f"{row.usage.registers} {row.arch}")
    used = "; ".join(f"{dtype}: {', '.join(rows)}" for dtype, rows in per_dtype.items())
    spilling = [r for r in check.rows if r.usage.short_of_registers]
    verdict = "no spills"
    if spilling:
        verdict = "spills allowed: " + ", ".join(
            f"{r.dtype.value} {r.arch} {r.usage.spill_store_bytes} B"
            + (" (wgmma serialized)" if r.usage.wgmma_serialized else "")
            for r in spilling
        )
    because = f", {why}" if why else ""
    return f"{used} (cap {cap}{because}; {check.compiler}; {verdict})"


def _live(kernel: Kernel) -> dict[str, str]:
    steps, _ = flow(kernel)  # the steps occupancy indexes (a tile's, no setup)
    return {name: live_text(steps, idx) for name, idx in occupancy(kernel).items()}


def _resources(compiled: Compiled, check: RegisterCheck) -> list[dict[str, Any]]:
    """The compiler's report per dtype and architecture, with the CTAs per SM it allows."""
    k = compiled.kernel
    rows = []
    for row in check.rows:
        u = row.usage
        occ = ctas_per_sm(u.registers, k.config.threads, k.smem_bytes, row.arch)
        limit = min((n, why) for why, n in occ.items() if why != "ctas_per_sm")[1]
        rows.append(
            {
                "dtype": row.dtype.value,
                "arch": row.arch,
                "registers": u.registers,
                "spill_bytes": u.spill_store_bytes + u.spill_load_bytes,
                "stack_bytes": u.stack_bytes,
                "smem_bytes": k.smem_bytes + u.static_smem_bytes,
                "ctas_per_sm": occ["ctas_per_sm"],
                "limited_by": limit,
            }
        )
    return rows


def explain_data(compiled: Compiled, registers: RegisterCheck | None = None) -> dict[str, Any]:
    """Everything `fadsl explain` prints, as plain data (the --json form). ``registers``:
    the compile-based register check, if it ran (fadsl.build.spill_check)."""
    registers = registers or RegisterCheck((), "not compiled")
    k = compiled.kernel
    cfg = k.config
    live = _live(k)
    assert k.smem_bytes is not None
    buffers = []
    for b in k.buffers:
        region = k.regions[b.region]
        buffers.append(
            {
                "buffer": b.name,
                "offset": b.offset,
                "bytes": b.nbytes,
                "region": b.region,
                "scope": b.scope.value,
                "live": live[b.name],
                "shares_with": [m for m in region.members if m != b.name],
            }
        )
    schedule = []
    for phase, items in k.phases():
        entries = []
        for item in items:
            if isinstance(item, Step):
                entries.append({"step": item.op.spelling, "what": item.title})
            else:
                entries.append(
                    {
                        "sync": item.text(),
                        "line": item.loc.line,
                        "serves": [h.describe() for h in item.serves],
                    }
                )
        schedule.append({"phase": phase.value, "items": entries})
    cap, why = _register_cap(compiled)
    data: dict[str, Any] = {
        "spec": compiled.file,
        "kernel": cfg.name,
        "target": cfg.target,
        "dtypes": [d.value for d in cfg.dtypes],
        "head_dim": cfg.head_dim,
        "block_r": cfg.block_r,
        "block_c": cfg.block_c,
        "warps": cfg.warps,
        "smem_alias": cfg.smem_alias.value,
        "smem": buffers,
        "regions": [
            {
                "region": r.index,
                "offset": r.offset,
                "bytes": r.nbytes,
                "members": list(r.members),
                "why": list(r.reasons),
            }
            for r in k.regions
        ],
        "smem_total": k.smem_bytes,
        "ctas_per_sm_by_smem": {
            f"{arch} ({family})": ctas_per_sm(0, cfg.threads, k.smem_bytes, arch)["smem"]
            for arch, family in compiled.target.capabilities.archs
        },
        "resources": _resources(compiled, registers),
        "compiler": registers.compiler,
        "register_cap": cap,
        "schedule": schedule,
    }
    if why:
        data["register_cap_why"] = why
    report = compiled.target.report
    if report is not None:
        data.update(report.explain_data(k))
    if k.backward is not None and report is not None and report.backward_data is not None:
        data["backward"] = report.backward_data(k)
    if cfg.modifiers is not None:
        data["modifiers"] = modifiers_data(cfg.modifiers)
    return data


def modifiers_data(m: Modifiers) -> dict[str, Any]:
    """The spec's score and mask modifiers as the passes left them (fadsl/passes/modifiers):
    each expression with its type, the score's derivative, the keep predicate's tile rule."""
    data: dict[str, Any] = {"inputs": [i.text() for i in m.inputs]}
    if m.score is not None:
        data["score"] = {
            "expr": text(m.score),
            "type": m.score.type.value,
            "derivative": text(m.derivative) if m.derivative is not None else None,
            "not_differentiable": m.not_differentiable or None,
            "distance_term": text(m.distance_term) if m.distance_term is not None else None,
            "input_grads": [
                {
                    "read": f"{g.input}[{g.index_text()}]",
                    "derivative": None if g.derivative is None else text(g.derivative),
                    "why": g.why or None,
                }
                for g in m.input_grads
            ],
        }
    if m.keep is not None:
        rule = m.rule
        data["keep"] = {
            "expr": text(m.keep),
            "type": m.keep.type.value,
            "full": text(rule.full),
            "empty": text(rule.empty),
            "exact": rule.exact,
            "why": rule.why,
            "by_pass": rule.by_pass,
            "per_head": rule.per_head,
        }
    if m.longest is not None:  # (check_modifiers: arithmetic in range only up to it)
        data["longest"] = {"seqlen": m.longest, "why": m.longest_why}
    return data


def modifiers_text(data: dict[str, Any]) -> list[str]:
    out = ["Modifiers (s: the score q.k softmax_scale, natural units)"]
    out += [f"  input {i}   (a keyword argument of the call)" for i in data["inputs"]]
    score = data.get("score")
    if score is not None:
        out.append(f"  score {score['expr']}   : {score['type']}")
        if score["derivative"] is not None:
            out.append(f"    d score / d s = {score['derivative']}")
        else:
            out.append(f"    no derivative: {score['not_differentiable']}")
        if score.get("distance_term") is not None:
            out.append(
                f"    s + f(q_idx - kv_idx), f = {score['distance_term']}: evaluated once a "
                "distance a warp's block meets, not once a score (split_distance_term)"
            )
        for g in score.get("input_grads", ()):  # a learnable input's gradient: dS' times it
            if g["derivative"] is not None:
                out.append(f"    d score / d {g['read']} = {g['derivative']}")
            else:
                out.append(f"    no derivative by {g['read']}: {g['why']}")
    keep = data.get("keep")
    if keep is not None:
        out.append(f"  keep {keep['expr']}   : {keep['type']}")
        out.append("    tile classes, for query rows q_lo .. q_hi against keys kv_lo .. kv_hi:")
        out.append(f"      FULL (no mask)          where {keep['full']}")
        out.append(f"      EMPTY (block skipped)   where {keep['empty']}")
        out.append("      PARTIAL (masked by keep) otherwise")
        out.append(f"    {'exact' if keep['exact'] else 'not exact'}: {keep['why']}")
        if keep["by_pass"]:
            out.append(
                "    and by a pass before the kernel, each call: the predicate at every score of "
                f"each tile{', per head' if keep['per_head'] else ''}; a tile is EMPTY, FULL or "
                "PARTIAL by what it finds, the kernel visiting each q block's list of its "
                "blocks that are not EMPTY and masking only PARTIAL ones (the backward: a pass "
                "of its own over its tiles, each n-block skipping the EMPTY m-blocks at each "
                "end of its range)"
            )
    longest = data.get("longest")
    if longest is not None:
        out.append(
            f"  calls of sequences up to {longest['seqlen']} only: past it {longest['why']} "
            "leaves its type's range (the call refuses longer ones)"
        )
    return out


def explain_text(compiled: Compiled, registers: RegisterCheck | None = None) -> str:
    data = explain_data(compiled, registers)
    report = compiled.target.report
    alias_key = "smem_alias" in compiled.target.keys  # sm_90a places its tiles one way
    # the columns widen for long entries (sm_90a's "warpgroup" scope)
    scope_w = max([6] + [len(b["scope"]) + 1 for b in data["smem"]])
    live_w = max([16] + [len(b["live"]) + 1 for b in data["smem"]])
    out = [
        f"{data['kernel']} ({data['spec']}): target {data['target']}, "
        f"{'/'.join(data['dtypes'])}, B_r = {data['block_r']}, B_c = {data['block_c']}, "
        f"head_dim = {data['head_dim']}, "
        + (report.threads_text(compiled.kernel) if report else f"{data['warps']} warps"),
        "",
        "SMEM map" + (f" (smem_alias {data['smem_alias']})" if alias_key else ""),
        f"  {'buffer':<7}{'offset':>7}{'bytes':>7}{'region':>8}  {'scope':<{scope_w}}"
        f"{'live':<{live_w}}shares with",
    ]
    for b in data["smem"]:
        out.append(
            f"  {b['buffer']:<7}{b['offset']:>7}{b['bytes']:>7}{b['region']:>8}  "
            f"{b['scope']:<{scope_w}}{b['live']:<{live_w}}{', '.join(b['shares_with']) or '-'}"
        )
    for r in data["regions"]:
        for why in r["why"]:
            out.append(f"  region {r['region']}: {why}")
    out.append(f"smem total: {data['smem_total']} bytes")
    for device, n in data["ctas_per_sm_by_smem"].items():
        out.append(f"CTAs per SM that this SMEM allows on {device}: {n}")
    out.append("")
    if report is not None:
        out += report.explain_sections(data)
    if not data["resources"]:
        out.append(f"Resources: not checked ({data['compiler']})")
    else:
        out.append(
            f"Resources ({data['compiler']}; at most {data['register_cap']} registers per "
            f"thread{_because(data)}): registers/thread, spills, SMEM/CTA and the CTAs per SM "
            "they allow"
        )
        for r in data["resources"]:
            out.append(
                f"  {r['dtype']} {r['arch']:<7} {r['registers']:>3} registers, {r['spill_bytes']} B spills, "
                f"{r['stack_bytes']} B stack, {r['smem_bytes']} B SMEM -> {r['ctas_per_sm']} CTAs/SM "
                f"(limited by {r['limited_by']})"
            )
    out.append("")
    if report is not None:
        out += report.explain_schedule(data)
    else:
        out += _schedule_text(data)
    if "backward" in data:  # the forward's report stays as it was; the backward follows it
        out += ["", *report.backward_sections(data["backward"])]
    if "modifiers" in data:
        out += ["", *modifiers_text(data["modifiers"])]
    return "\n".join(out) + "\n"


def _schedule_text(data: dict[str, Any]) -> list[str]:
    out = ["Schedule (each sync with the hazards it orders)"]
    for phase in data["schedule"]:
        title = phase["phase"] + (
            " (once per KV block)" if phase["phase"] == Phase.MAINLOOP.value else ""
        )
        out.append(f"  {title}")
        for item in phase["items"]:
            if "step" in item:
                out.append(f"    {item['step']:<10} {item['what']}")
            else:
                out.append(f"    >> {item['sync']}")
                out.extend(f"         {h}" for h in item["serves"])
    return out


def _because(data: dict[str, Any]) -> str:
    why = data.get("register_cap_why")
    return f", {why}" if why else ""
