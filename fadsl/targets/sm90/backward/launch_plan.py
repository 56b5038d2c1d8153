"""A padded backward call's launch plan (issues 44, 45; research/backward-launch-plan.md).

``plan`` launches a call as ``host.run`` does and returns, beside its gradients, what a later
call of the same signature (shapes, strides, dtypes, devices, scale, stream) needs to launch
the same kernels without checking or packing again: each kernel's params as packed, with the
slots of every address in them (``AddressSlot``, by the names of host.py's address tuples,
the names the packing reads), a ``make`` that allocates the call's dq, dk, dv and workspace
as ``run`` does, and the ``finish`` that turns them into the gradients. Not planned: a keep
classed by the call's own pass (its classes' workspaces are made in the call), a learnable
variant's call (its buffers are zeroed and filled per call), packed sequences (cu_seqlens'
values set the grids).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ...launch import INPUT_SOURCES, AddressSlot, CallPlan, KernelLaunch, KernelStep
from ..host.tma import MAP_BYTES
from . import host

# A call's addresses in the order a plan's launches take them: the call's tensors, then what
# ``make`` returns (host.MADE), then the modifiers' inputs (INPUT_SOURCES)
CALL_SOURCES = ("q", "k", "v", "out", "lse", "dout", "dlse")
MAIN_ADDRESSES_OFFSET = len(host.MAIN_MAPS) * MAP_BYTES


class BackwardCallPlan:
    """A backward signature's kernels: ``steps``, one CallPlan per kernel in launch order (its
    slots name CALL_SOURCES, host.MADE and INPUT_SOURCES); ``make(q, k, v)`` the call's
    tensors in host.MADE's order; ``finish(made)`` -> (dq, dk, dv); ``held``: the planned
    call's made tensors (their addresses are in the steps' params)."""

    def __init__(self, steps: tuple[CallPlan, ...], make: Callable, finish: Callable, held):
        self.steps, self.make, self.finish, self.held = steps, make, finish, held

    @staticmethod
    def sources(inputs: int) -> tuple[str, ...]:
        return (*CALL_SOURCES, *host.MADE, *INPUT_SOURCES[:inputs])


def plan(
    kernel, launch: Callable[[KernelLaunch], None], q, k, v, out, lse, dout, dlse,
    softmax_scale: float, inputs: tuple = (), classes=None,
) -> tuple[tuple[Any, Any, Any], BackwardCallPlan | None]:  # fmt: skip
    """``host.run``'s call (its launches through ``launch``) and its plan (None: not
    plannable)."""
    call = host.padded_call(
        kernel, q, k, v, out, lse, dout, dlse, softmax_scale, inputs, classes=classes
    )
    grads = call.launched(launch, k, v)
    if not call.plannable:
        return grads, None
    steps = tuple(
        CallPlan(kl.params, (KernelStep(kl.suffix, kl.grid, kl.block),), slots(kl.suffix, call))
        for kl in call.launches
    )
    make = functools.partial(host.make, call.sizes, kernel.config.head_dim)
    finish = functools.partial(host.finish, call.sizes, (k.dtype, v.dtype))
    return grads, BackwardCallPlan(steps, make, finish, call.made)


def slots(suffix: str, call: host.PackedCall) -> tuple[AddressSlot, ...]:
    """Every address in kernel ``suffix``'s params of ``call``: the fields host.py packs from
    its address tuples (those the call leaves 0 have none), the workspace's parts as the
    workspace's address plus their offsets."""
    where = {name: ("workspace", offset) for name, offset in call.sizes.parts}

    def pointers(base: int, names) -> tuple[AddressSlot, ...]:
        return tuple(
            AddressSlot(base + 8 * i, *where.get(name, (name, 0)))
            for i, name in enumerate(names)
            if call.addresses[name]
        )

    if suffix == "_preprocess":
        return pointers(0, host.PREP_ADDRESSES)
    if suffix == "_convert_dq":
        return pointers(0, host.CONVERT_ADDRESSES)
    if suffix != "":
        raise ValueError(f"a plan has no slots for kernel {suffix!r}")
    found = tuple(
        AddressSlot(MAP_BYTES * i, name, 0, True) for i, name in enumerate(host.MAIN_MAPS)
    )
    found += pointers(MAIN_ADDRESSES_OFFSET, host.MAIN_ADDRESSES)
    inputs = tuple(name for name in INPUT_SOURCES if name in call.addresses)
    found += pointers(host.MODIFIERS_OFFSET, inputs)
    if call.sizes.fused:
        found += pointers(host.FUSED_OFFSET, ("dq",))
    if call.dkv_maps:
        found += tuple(
            AddressSlot(host.DKV_MAPS_OFFSET + MAP_BYTES * i, name, 0, True)
            for i, name in enumerate(("dk", "dv"))
        )
    return found
