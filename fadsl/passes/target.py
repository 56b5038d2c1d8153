"""What the generic passes ask of a target: its name, its capabilities (the SMEM per CTA)
and its sync model. The pipeline hands each pass the kernel's target (fadsl/targets'
``Target`` has these fields); the passes never look one up themselves, so that they sit
below the targets (README, "Layout")."""

from __future__ import annotations

from typing import Protocol

from ..ir.syncmodel import SyncModel


class PassCapabilities(Protocol):
    """The part of a target's ``Capabilities`` (fadsl/targets) the passes read."""

    smem_per_cta: int


class PassTarget(Protocol):
    name: str
    capabilities: PassCapabilities
    sync_model: SyncModel
