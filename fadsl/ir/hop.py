"""One hop of a tensor's path: from one memory level to the next, by one instruction.

The forward's tensors (fadsl.ir.kernel.Tensor) and the backward block's
(fadsl.ir.backward.BackwardTensor) are both made of hops; this module sits below both so
that the kernel can hold its backward block without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Loc
from .types import Instr, Level


@dataclass(frozen=True)
class Hop:
    src: Level
    dst: Level
    instr: Instr
    loc: Loc
