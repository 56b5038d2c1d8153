"""Text for people and tools: the IR printer, `fadsl check`'s summary and `fadsl explain`."""

from __future__ import annotations

from typing import Any

from .ir import Kernel, Phase, Step, Sync
from .lower import OP_TEXT
from .passes.plan_smem import occupancy
from .pipeline import Compiled

# SMEM per SM and the bytes the driver reserves per CTA, by GPU family.
DEVICES = (
    ("sm_80", "A100", 164 * 1024, 1024),
    ("sm_90", "H100/H200", 228 * 1024, 1024),
)
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32


def ctas_per_sm(smem_bytes: int, threads: int, smem_per_sm: int, reserved: int) -> int:
    by_smem = smem_per_sm // (smem_bytes + reserved)
    return min(by_smem, MAX_THREADS_PER_SM // threads, MAX_CTAS_PER_SM)


def format_kernel(kernel: Kernel) -> str:
    """A deterministic dump of the IR, for golden tests of each pass."""
    cfg = kernel.config
    out = [
        f"kernel {cfg.name} target={cfg.target.value} "
        f"dtypes={','.join(d.value for d in cfg.dtypes)} head_dim={cfg.head_dim} "
        f"B_r={cfg.block_r} B_c={cfg.block_c} warps={cfg.warps} mask={cfg.mask.value} "
        f"swizzle={cfg.swizzle or 'none'} smem_alias={cfg.smem_alias.value}"
    ]
    for t in kernel.tensors:
        out.append(f"tensor {t.role.value}: {t.path_text()}")
    for b in kernel.buffers:
        place = "unplanned" if b.offset is None else f"offset={b.offset} region={b.region}"
        out.append(
            f"buffer {b.name} {b.rows}x{b.cols}x{b.elem_bytes}B scope={b.scope.value} {place}"
        )
    for r in kernel.regions:
        out.append(
            f"region {r.index} offset={r.offset} bytes={r.nbytes} members={','.join(r.members)}"
        )
        out.extend(f"  why: {why}" for why in r.reasons)
    if kernel.smem_bytes is not None:
        out.append(f"smem_bytes {kernel.smem_bytes}")
    for phase, items in kernel.phases():
        out.append(f"{phase.value}:")
        for item in items:
            if isinstance(item, Step):
                acc = ", ".join(
                    f"{a.mode.value} {a.buffer}/{a.partition.value}" for a in item.accesses
                )
                flag = " async" if item.is_async else ""
                out.append(f"  step {item.op}{flag}" + (f" [{acc}]" if acc else ""))
            else:
                out.append(f"  sync {item.text()}")
                out.extend(f"    serves {h.describe()}" for h in item.serves)
    return "\n".join(out) + "\n"


def summary(compiled: Compiled) -> str:
    """`fadsl check`: the configuration in a few lines."""
    k = compiled.kernel
    cfg = k.config
    rows = cfg.block_r // cfg.warps
    order = ", ".join(OP_TEXT[s.op] for s in k.mainloop if isinstance(s, Step))
    lines = [
        f"{compiled.file}: ok",
        f"  kernel    {cfg.name} (target {cfg.target.value})",
        f"  dtypes    {', '.join(d.value for d in cfg.dtypes)} (fp32 softmax and accumulators)",
        f"  tiles     B_r = {cfg.block_r}, B_c = {cfg.block_c}, head_dim = {cfg.head_dim}",
        f"  warps     {cfg.warps} ({cfg.threads} threads; {rows} query rows per warp)",
        f"  mask      {cfg.mask.value}",
        f"  swizzle   {cfg.swizzle or 'none'}",
        f"  smem      {k.smem_bytes} bytes ({cfg.smem_alias.value} aliasing)",
    ]
    lines += [f"  {t.role.value}         {t.path_text()}" for t in k.tensors]
    lines.append(f"  mainloop  {order}")
    return "\n".join(lines) + "\n"


def _live(kernel: Kernel) -> dict[str, str]:
    steps = kernel.steps()
    result = {}
    for name, idx in occupancy(kernel).items():
        ops = [steps[i].op for i in sorted(idx)]
        result[name] = f"{ops[0]}..{ops[-1]}" if ops else "-"
    return result


def explain_data(compiled: Compiled) -> dict[str, Any]:
    """Everything `fadsl explain` prints, as plain data (the --json form)."""
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
                entries.append({"step": item.op, "what": item.title})
            else:
                entries.append(
                    {
                        "sync": item.text(),
                        "line": item.loc.line,
                        "serves": [h.describe() for h in item.serves],
                    }
                )
        schedule.append({"phase": phase.value, "items": entries})
    return {
        "spec": compiled.file,
        "kernel": cfg.name,
        "target": cfg.target.value,
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
        "ctas_per_sm": {
            f"{arch} ({name})": ctas_per_sm(k.smem_bytes, cfg.threads, per_sm, reserved)
            for arch, name, per_sm, reserved in DEVICES
        },
        "schedule": schedule,
    }


def explain_text(compiled: Compiled) -> str:
    data = explain_data(compiled)
    out = [
        f"{data['kernel']} ({data['spec']}): target {data['target']}, "
        f"{'/'.join(data['dtypes'])}, B_r = {data['block_r']}, B_c = {data['block_c']}, "
        f"head_dim = {data['head_dim']}, {data['warps']} warps",
        "",
        f"SMEM map (smem_alias {data['smem_alias']})",
        f"  {'buffer':<7}{'offset':>7}{'bytes':>7}{'region':>8}  {'scope':<6}{'live':<16}shares with",
    ]
    for b in data["smem"]:
        out.append(
            f"  {b['buffer']:<7}{b['offset']:>7}{b['bytes']:>7}{b['region']:>8}  {b['scope']:<6}"
            f"{b['live']:<16}{', '.join(b['shares_with']) or '-'}"
        )
    for r in data["regions"]:
        for why in r["why"]:
            out.append(f"  region {r['region']}: {why}")
    out.append(f"smem total: {data['smem_total']} bytes")
    for device, n in data["ctas_per_sm"].items():
        out.append(f"CTAs per SM that this SMEM allows on {device}: {n}")
    out.append("")
    out.append("Schedule (each sync with the hazards it orders)")
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
    return "\n".join(out) + "\n"
