"""A keep's tile classes made once and reused over calls (issue 41).

A spec whose `keep` reads inputs per token (document ids: ``TileRule.by_pass``) classes its
tiles in every call, forward and backward, with a pass over every score of the causal part
(48 and 52 us at 16k tokens on an H200). A model calls every layer with the same ids, so
``kern.keep_classes(q, k, q_doc=..., kv_doc=...)`` makes them once (FlexAttention's
``create_block_mask`` is the same idea) and each call takes them back:
``kern(q, k, v, q_doc=..., kv_doc=..., keep_classes=classes)``.

Under torch.compile the argument is set aside and each call classes its own tiles (the
checks below would run at trace time only). A ``KeepClasses`` is tied to what it was made from,
and a call that does not match is refused by name (never a silent wrong mask): the kernel (its
op name), q's batch, queries and heads, k's keys and heads, and the very input tensors, at the
versions they had (an in-place write to an id tensor bumps its version; torch cannot see a
write through ``.data`` or a raw pointer, so ids written that way need new classes). Its four
tensors ride after the spec's inputs (the eager autograd Function's and the launches' input
lists), the forward's class bytes and ranges, then the backward's, which the runtime splits
off again (``split``). Making them runs the backward's pass too where the spec has a backward
(its cubin built on first use); a learnable variant whose backward takes other tiles (B_r 64
for the spec's 80) classes its own in each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..targets.launch import Args, current_stream

ARGUMENT = "keep_classes"  # the call's keyword


@dataclass(frozen=True, eq=False)
class KeepClasses:
    """Tile classes of one kernel's keep for calls of one shape on the same inputs."""

    kernel: str  # the op name of the kernel that made them (its spec hash)
    sizes: tuple[int, int, int, int, int]  # q's batch, queries, heads; k's keys, heads
    inputs: tuple  # the spec's input tensors they were made from, in declared order
    versions: tuple[int, ...]  # and those tensors' versions then
    forward: tuple  # (class bytes, ranges) at the forward's tiles
    backward: tuple  # (B_r, B_c, class bytes, ranges) at the backward's, or () without one

    def tensors(self) -> list:
        """The tensors an op's input list carries after the spec's inputs."""
        return [*self.forward, *(self.backward[2:] if self.backward else self.forward)]


def sizes_of(q, k) -> tuple[int, int, int, int, int]:
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[1], k.shape[2])


def make(kern, q, k, tensors: tuple) -> KeepClasses:
    """``kern``'s tile classes for calls on q's and k's shapes and ``tensors`` (the spec's
    inputs, checked), made on q's device and current stream."""
    import torch

    from ..targets.archs import arch_for

    kernel = kern.compiled.kernel
    dtype = kern.check_inputs(q, k, k)
    found = kern._launch.before(kernel, q, k)
    if found is None:
        raise TypeError(
            f"kernel '{kern.config.name}' classes no tiles per call (its keep does not read "
            "inputs per token): call it without keep_classes"
        )
    hidden, first = found
    index = q.device.index
    args = Args(q, k, k, q, None, 1.0, tuple(tensors) + hidden)  # (the pass reads sizes, inputs)
    params = kern._launch.pack(kernel, args)
    module = kern.kernel_module(dtype, index, first.suffix, first.block[0])
    with torch.cuda.device(index):
        module.launch(first.grid, first.block, params, current_stream(index))
    backward = ()
    if kern.has_backward:
        kernels = kern._backward_kernels()
        arch = arch_for(torch.cuda.get_device_capability(index))
        backward = kernels.classes_only(dtype, arch, q, k, tuple(tensors))
    return KeepClasses(
        kern.op_name,
        sizes_of(q, k),
        tuple(tensors),
        tuple(t._version for t in tensors),
        hidden,
        backward,
    )


def taken(inputs: dict):
    """The call's keep_classes, popped from its keyword inputs: None where it passed none,
    and under torch.compile, where the checks below would hold at trace time only (a later
    call with other ids would not be refused): there each call classes its own tiles."""
    import torch

    classes = inputs.pop(ARGUMENT, None)
    return None if torch.compiler.is_compiling() else classes


def check(kern, classes: Any, q, k, tensors: tuple) -> None:
    """Refuse ``classes`` (the call's keep_classes) where they were not made by this kernel
    for these shapes and these very inputs, unchanged."""
    name = kern.config.name
    if not isinstance(classes, KeepClasses):
        raise TypeError(
            f"keep_classes must be what kernel '{name}'.keep_classes(q, k, ...) returned, got "
            f"{type(classes).__name__}"
        )
    if classes.kernel != kern.op_name:
        raise ValueError(
            f"keep_classes were made by kernel '{classes.kernel}', not by '{kern.op_name}'"
        )
    if classes.sizes != sizes_of(q, k):
        raise ValueError(
            "keep_classes were made for (batch, seqlen_q, heads, seqlen_k, heads_kv) = "
            f"{classes.sizes}, "
            f"but this call's q and k give {sizes_of(q, k)}"
        )
    for made, given, version, decl in zip(
        classes.inputs, tensors, classes.versions, kern.config.modifiers.inputs
    ):
        if made is not given:
            raise ValueError(
                f"keep_classes were made from another tensor than this call's {decl.name}: "
                "pass the same tensor, or make the classes again"
            )
        if given._version != version:
            raise ValueError(
                f"{decl.name} was written in place after keep_classes were made from it: "
                "make the classes again"
            )


def split(kern, inputs: tuple) -> tuple[tuple, tuple | None, tuple | None]:
    """An op's input list as (the spec's inputs, the forward's classes or None, the
    backward's (B_r, B_c, class bytes, ranges) or None): classes ride after the spec's
    inputs only where the call passed keep_classes."""
    count = len(kern.config.modifiers.inputs) if kern.config.modifiers is not None else 0
    inputs = tuple(inputs)
    if len(inputs) == count:
        return inputs, None, None
    if len(inputs) != count + 4:
        names = ", ".join(d.name for d in kern.config.modifiers.inputs)
        raise TypeError(
            f"kernel '{kern.config.name}' reads inputs ({names}): call it with them as keyword "
            f"arguments; it takes {count} inputs (then, made ahead, the 4 tensors of its "
            f"keep_classes), got {len(inputs)}"
        )
    bwd = kern.compiled.kernel.backward
    backward = None if bwd is None else (bwd.block_m, bwd.block_n, *inputs[count + 2 : count + 4])
    return inputs[:count], inputs[count : count + 2], backward
