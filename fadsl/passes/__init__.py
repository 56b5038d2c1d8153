"""The compiler's passes; each is a pure function Kernel -> Kernel."""

from .insert_barriers import insert_barriers
from .plan_smem import plan_smem
from .verify import verify

__all__ = ["plan_smem", "insert_barriers", "verify"]
