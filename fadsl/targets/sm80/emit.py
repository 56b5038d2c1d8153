"""sm_80's emitter glue: the template's slots, computed from the planned kernel.

The template (emit/sm80/kernel.cu.j2) holds the kernel's structure; each step's
code is a macro of emit/sm80/ops.cu.j2, named here per (op, phase), and each
sync is rendered from its kind with a comment naming the hazards it orders.
"""

from __future__ import annotations

from typing import Any

from ...ir import Dtype, Kernel, Phase, Step, Sync
from ...ir.ops import Op
from .caps import CP_ASYNC_WAIT, SYNCTHREADS, SYNCWARP

TEMPLATE = "sm80/kernel.cu.j2"

# The ops.cu.j2 macro that renders each op in each phase where the schedule may put it.
_MACROS: dict[tuple[Op, Phase], str] = {
    (Op.INIT, Phase.PROLOGUE): "zero_state",
    (Op.Q_G2S, Phase.PROLOGUE): "load_q",
    (Op.Q_S2R, Phase.PROLOGUE): "q_to_registers",
    (Op.K_G2S, Phase.PROLOGUE): "load_kv_first",
    (Op.V_G2S, Phase.PROLOGUE): "load_kv_first",
    (Op.K_G2S, Phase.MAINLOOP): "load_kv",
    (Op.V_G2S, Phase.MAINLOOP): "load_kv",
    (Op.K_G2S_NEXT, Phase.MAINLOOP): "load_kv_next",
    (Op.V_G2S_NEXT, Phase.MAINLOOP): "load_kv_next",
    (Op.K_S2R, Phase.MAINLOOP): "k_to_registers",
    (Op.QK, Phase.MAINLOOP): "gemm_qk",
    (Op.SOFTMAX, Phase.MAINLOOP): "online_softmax",
    (Op.V_S2R, Phase.MAINLOOP): "v_to_registers",
    (Op.PV, Phase.MAINLOOP): "gemm_pv",
    (Op.NORMALIZE, Phase.EPILOGUE): "finish_rows",
    (Op.O_R2S, Phase.EPILOGUE): "store_o_to_smem",
    (Op.O_S2G, Phase.EPILOGUE): "store_o_to_gmem",
}


def _sync_comment(sync: Sync) -> str:
    if sync.kind == CP_ASYNC_WAIT:
        landed = "all" if sync.groups == 0 else f"all but the newest {sync.groups}"
        head = (
            f"cp.async.wait_group {sync.groups}: {landed} of this thread's copy groups have "
            "landed; completes:"
        )
    elif sync.kind == SYNCWARP:
        head = "warp barrier; orders:"
    elif sync.kind == SYNCTHREADS:
        head = "CTA barrier; orders:"
    else:
        raise AssertionError(f"sm_80 has no sync {sync.kind.name}")
    return "\n".join([head] + [f"  {h.describe()}" for h in sync.serves])


def _item(item: Step | Sync) -> dict[str, Any]:
    match item:
        case Step():
            macro = _MACROS.get((item.op, item.phase))
            if macro is None:
                raise AssertionError(f"sm_80 cannot render {item.op} in the {item.phase.value}")
            tensor = item.op.tensor
            return {
                "kind": "step",
                "op": item.op.spelling,
                "macro": macro,
                "tensor": "" if tensor is None else tensor.value.lower(),
                "comment": item.title,
            }
        case Sync(kind=kind) if kind == CP_ASYNC_WAIT:
            return {"kind": "wait", "groups": item.groups, "comment": _sync_comment(item)}
        case Sync(kind=kind) if kind == SYNCWARP:
            return {"kind": "sync", "sync": "syncwarp", "comment": _sync_comment(item)}
        case Sync(kind=kind) if kind == SYNCTHREADS:
            return {"kind": "sync", "sync": "syncthreads", "comment": _sync_comment(item)}
        case _:
            raise AssertionError(f"cannot render {item!r}")


def context(kernel: Kernel, dtype: Dtype) -> dict[str, Any]:
    """The template's sm_80 slots (codegen adds the names, version and hash)."""
    cfg = kernel.config
    assert kernel.smem_bytes is not None, "render a kernel only after plan_smem"
    buffers = {}
    for buf in kernel.buffers:
        swz = buf.swizzle
        buffers[buf.name] = {
            "offset": buf.offset,
            "rows": buf.rows,
            "cols": buf.cols,
            "swizzle": None if swz is None else [swz.bits, swz.base, swz.shift],
        }
    return {
        "head_dim": cfg.head_dim,
        "block_r": cfg.block_r,
        "block_c": cfg.block_c,
        "warps": cfg.warps,
        "mask": cfg.mask.value,
        "smem_bytes": kernel.smem_bytes,
        "buffers": buffers,
        "reg_load": {t.role.value: t.reg_load.value for t in kernel.tensors},
        "phases": [
            {"name": phase.value, "items": [_item(i) for i in items]}
            for phase, items in kernel.phases()
        ],
    }
