"""The front end's output: a spec's validated config, its tensors' paths and the mainloop
order it asked for, which a target's schedule builder turns into a Kernel."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Loc
from .kernel import Config, Tensor
from .ops import Op


@dataclass(frozen=True)
class Lowered:
    config: Config
    tensors: tuple[Tensor, ...]
    order: tuple[tuple[Op, Loc], ...]  # mainloop ops with the location that asked for each
