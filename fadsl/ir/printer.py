"""A deterministic text form of the IR, for golden tests of each pass and for hashing.

fadsl.irread parses it back (print, read, print is the identity), so that a pass
test can start from IR written by hand."""

from __future__ import annotations

from .kernel import Kernel, Step
from .types import Mask, Threads


def format_kernel(kernel: Kernel) -> str:
    """A deterministic dump of the IR, for golden tests of each pass."""
    cfg = kernel.config
    out = [
        f"kernel {cfg.name} target={cfg.target} "
        f"dtypes={','.join(d.value for d in cfg.dtypes)} head_dim={cfg.head_dim} "
        f"B_r={cfg.block_r} B_c={cfg.block_c} warps={cfg.warps} mask={cfg.mask.value} "
        f"swizzle={cfg.swizzle or 'none'} smem_alias={cfg.smem_alias.value}"
        + (" spills=allow" if cfg.allow_spills else "")
        + (f" window={cfg.window.left},{cfg.window.right}" if cfg.window else "")
        + (f" output={cfg.out_dtype.value}" if cfg.out_dtype else "")
    ]
    if cfg.ext is not None:
        out.append(cfg.ext.text())
    if cfg.modifiers is not None:  # (kernels without modifiers print as they always have)
        out.extend(f"modifier {line}" for line in cfg.modifiers.lines())
    if kernel.backward is not None:  # forward-only kernels print as they always have
        out.append(kernel.backward.text())
    for t in kernel.tensors:
        out.append(f"tensor {t.role.value}: {t.path_text()}")
    for b in kernel.buffers:
        place = "unplanned" if b.offset is None else f"offset={b.offset} region={b.region}"
        out.append(
            f"buffer {b.name} {b.rows}x{b.cols}x{b.elem_bytes}B"
            + (f" slots={b.slots}" if b.slots != 1 else "")
            + f" scope={b.scope.value} {place}"
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
                flag = "" if item.async_kind is None else f" {item.async_kind.flag}"
                if item.lag is not None:
                    flag += f" item=it{item.lag:+d}" if item.lag else " item=it"
                who = "" if item.who is Threads.ALL_WARPS else f" by {item.who.value}"
                out.append(f"  step {item.op.spelling}{flag}{who}" + (f" [{acc}]" if acc else ""))
            else:
                out.append(f"  sync {item.text()}")
                out.extend(f"    serves {h.describe()}" for h in item.serves)
                if item.note:
                    out.append(f"    note: {item.note}")
    if kernel.loop_may_be_empty != (cfg.mask is Mask.CAUSAL):  # irread's default otherwise
        out.append(f"loop_may_be_empty {str(kernel.loop_may_be_empty).lower()}")
    return "\n".join(out) + "\n"
