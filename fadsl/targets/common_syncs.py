"""The sync kinds more than one target's sync model holds, defined once: a CTA barrier
means the same to sm_80 and sm_90a, so both targets import it from here."""

from __future__ import annotations

from ..ir import Scope
from ..ir.syncmodel import SyncKind

SYNCTHREADS = SyncKind("__syncthreads()", "a CTA barrier", scope=Scope.CTA, cost=10)
