"""The front end's output: a spec's validated config, its tensors' paths, the mainloop
order it asked for and its backward block, which a target's schedule builder turns into a
Kernel."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Loc
from .backward import Backward
from .kernel import Config, Tensor
from .ops import Op


@dataclass(frozen=True)
class Lowered:
    config: Config
    tensors: tuple[Tensor, ...]
    order: tuple[tuple[Op, Loc], ...]  # mainloop ops with the location that asked for each
    backward: Backward | None = None  # the spec's backward block, validated; None: forward-only
