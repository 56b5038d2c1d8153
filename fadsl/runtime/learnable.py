"""Gradients of a score's learnable inputs (issue 41) at run time: which inputs of a call
learn, the refusals (each naming the input, located in the spec where the reason is the
spec's), and the backward's variant that computes their gradients.

An f32 input the score reads learns when it requires grad: the call goes through the
modified op (fadsl/runtime/modified_op.py), whose backward runs the variant of the spec's
backward kernels with ``Modifiers.learn`` set (fadsl/targets/sm90/learn.py: kLearn), built
on first use and cached as the spec's own. The kernels add into one fp32 buffer, zeroed
here, the learnable inputs' elements in declared order; the op's backward hands each input
its slice (the inputs are f32, so no conversion).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import Diagnostic, SpecError
from ..ir import Dtype
from ..passes.modifiers.input_grads import learnable
from . import keep_classes


def learning(kern, decls, tensors) -> tuple[bool, ...]:
    """Per declared input, whether it learns in this call (it requires grad, under grad
    mode); raises where one requires grad but cannot learn, or the spec cannot give it."""
    import torch

    if not torch.is_grad_enabled():
        return tuple(False for _ in decls)
    learn = tuple(bool(t.requires_grad) for t in tensors)
    for decl, wants in zip(decls, learn):
        if wants:
            check_learnable(kern, decl.name)
    return learn


def check_learnable(kern, name: str) -> None:
    cfg = kern.config
    refusal = f"fadsl kernel '{cfg.name}': input '{name}' requires grad, but"
    fix = f"pass {name}.detach(), or call under torch.no_grad()"
    found = learnable(cfg.modifiers, name)
    if not found.ok:
        where = _located(kern, found.loc, found.why) if found.loc is not None else found.why
        raise RuntimeError(f"{refusal} it has no gradient here ({fix}):\n{where}")
    bwd = kern.compiled.kernel.backward
    if bwd is None:
        raise RuntimeError(
            f"{refusal} the spec has no backward block: add a `backward {{}}` block, or {fix}"
        )
    if bwd.deterministic:
        raise RuntimeError(
            f"{refusal} its gradient is added by atomics in no fixed order and the backward "
            f"block says `deterministic on`: learnable inputs with deterministic gradients "
            f"are not built yet; use `deterministic off`, or {fix}"
        )


def _located(kern, loc, message: str) -> str:
    """``file:line:col: message`` with the spec's line and a caret, as a SpecError shows it."""
    source = getattr(kern.compiled, "source", "") or ""
    return SpecError([Diagnostic(loc, message)], source).render()


def learnable_names(decls, learn) -> tuple[str, ...]:
    return tuple(d.name for d, wants in zip(decls, learn) if wants)


def buffer_size(tensors, learn) -> int:
    """Elements of the fp32 gradient buffer: the learnable inputs', end to end."""
    return sum(t.numel() for t, wants in zip(tensors, learn) if wants)


def split_buffer(flat, tensors, learn) -> list:
    """Each input's gradient (a view of ``flat``), None where it does not learn."""
    grads, offset = [], 0
    for t, wants in zip(tensors, learn):
        if wants:
            grads.append(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        else:
            grads.append(None)
    return grads


def variant_kernels(kern, names: tuple[str, ...]):
    """The spec's backward kernels with ``names``' gradients (BackwardKernels), cached on
    the FlashAttention object per set of names. Where the target gives the variant other
    backward lines (``BackwardLaunch.learn_lines``: sm_90a's B_r 64 for a B_r 80 block, whose
    variant spills), the spec's text with them goes through the pipeline again (validated,
    its passes and proof run) and the variant is of that kernel; the spec's own backward
    stays as it is."""
    from .backward import BackwardKernels

    cache = kern.__dict__.setdefault("_learn_backward", {})
    found = cache.get(names)
    if found is None:
        variant = learn_variant(kern.compiled, names)
        found = cache[names] = BackwardKernels(variant, kern.verbose, kern.cubin_dirs)
    return found


def learn_variant(compiled, names: tuple[str, ...]):
    """The Compiled whose kernel's backward computes ``names``' gradients (variant_kernels's)."""
    compiled = _variant_spec(compiled)
    cfg = compiled.kernel.config
    modifiers = replace(cfg.modifiers, learn=names)
    return replace(
        compiled, kernel=replace(compiled.kernel, config=replace(cfg, modifiers=modifiers))
    )


def _variant_spec(compiled):
    """``compiled``, or its spec with the target's learn_lines in the backward block."""
    from .. import targets
    from ..frontend.rewrite import rewrite_backward
    from ..pipeline import compile_source

    kernel = compiled.kernel
    hook = targets.get(kernel.config.target).backward_launch.learn_lines
    settings, paths = hook(kernel.backward) if hook is not None else ({}, {})
    if not settings and not paths:
        return compiled
    text = rewrite_backward(compiled.source, settings, paths, kernel.config.name)
    return compile_source(text, compiled.file)


def check_spills(kernels, dtype: Dtype, arch: str) -> None:
    """A learnable variant that spills is refused (the spec's own backward is checked by
    `fadsl check`; the variant is built here, on first use)."""
    entry = kernels.cubin(dtype, arch)
    ptxas = entry.meta.get("ptxas", {}) if isinstance(entry.meta, dict) else {}
    spilled = max(
        int(ptxas.get(k, 0)) for k in ("spill_store_bytes", "spill_load_bytes", "stack_bytes")
    )
    if spilled:
        learn = ", ".join(kernels.kernel.config.modifiers.learn)
        raise RuntimeError(
            f"fadsl kernel '{kernels.kernel.config.name}': the backward that computes the "
            f"gradients of {learn} spills registers ({spilled} bytes, {dtype.value}, {arch}) at "
            "the backward block's tile; it is refused rather than run slowly: try a smaller "
            "B_r in the backward block, or detach the input"
        )


def backward(kern, arch: str, q, k, v, out, lse, dout, dlse, scale: float, inputs, learn):
    """(dq, dk, dv, the fp32 gradient buffer) with ``learn``'s inputs' gradients, on q's
    device (architecture ``arch``)."""
    import torch

    from .arguments import backward_operands, lse_shape

    names = learnable_names(kern.config.modifiers.inputs, learn)
    dtype = kern.check_inputs(q, k, v)
    dout, lse, dlse = backward_operands(out, lse, dout, dlse, lse_shape(q), q.device)
    kernels = variant_kernels(kern, names)
    check_spills(kernels, dtype, arch)
    flat = torch.zeros(buffer_size(inputs, learn), device=q.device, dtype=torch.float32)
    inputs, _, classes = keep_classes.split(kern, inputs)  # (used where the tiles agree)
    dq, dk, dv = kernels(
        dtype, arch, q, k, v, out, lse, dout, dlse, scale, inputs, input_grads=flat, classes=classes
    )
    return dq, dk, dv, flat
