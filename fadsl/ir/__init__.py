"""The IR: the vocabulary (types), the nodes (kernel), the ops and sync kinds, the front
end's output (lowered), and the text form (printer; tests/ir_reader.py reads it back).

``from fadsl.ir import Config`` reaches the nodes and the vocabulary; the modules of this
package import each other directly, never this one.
"""

from .backward import Backward, BackwardTensor
from .kernel import (
    Item,
    Swizzle,
    Hop,
    Tensor,
    TargetConfig,
    Config,
    Buffer,
    Access,
    Step,
    Hazard,
    Sync,
    Region,
    Kernel,
    Window,
)
from .lowered import Lowered
from .types import (
    Dtype,
    Mask,
    Level,
    Instr,
    Scope,
    RegLoad,
    Role,
    GradRole,
    AliasPolicy,
    Rescale,
    Phase,
    Partition,
    Mode,
    HazardKind,
    Threads,
    Parity,
    WARPGROUP_THREADS,
)

__all__ = [
    "WARPGROUP_THREADS",
    "Item",
    "Access",
    "AliasPolicy",
    "Backward",
    "BackwardTensor",
    "Buffer",
    "Config",
    "Dtype",
    "GradRole",
    "Hazard",
    "HazardKind",
    "Hop",
    "Instr",
    "Kernel",
    "Level",
    "Lowered",
    "Mask",
    "Mode",
    "Parity",
    "Partition",
    "Phase",
    "RegLoad",
    "Region",
    "Rescale",
    "Role",
    "Scope",
    "Step",
    "Swizzle",
    "Sync",
    "TargetConfig",
    "Tensor",
    "Threads",
    "Window",
]
