"""The op vocabulary: every schedule step is one ``Op``, named by its spelling in the IR.

This table is the only place that knows an op's name, the tensor it moves, the kind
of move and how the spec's mainloop spells it; everything else asks it. A target's
schedule builder decides which ops a kernel runs and how (its instructions), and its
emitter how each is rendered.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .types import Role


class Move(Enum):
    """What a step does with its tensor's tile."""

    G2S = "gmem -> smem"
    S2R = "smem -> rf"
    R2S = "rf -> smem"
    S2G = "smem -> gmem"
    S2S = "smem -> smem"
    COMPUTE = "registers only (or a fragment-wise SMEM read by an mma)"


@dataclass(frozen=True)
class _Info:
    tensor: Role | None
    move: Move
    loop_text: str | None  # the mainloop line that asks for it; None: not a mainloop step
    ahead: bool = False  # loads the next block's tile (the prologue loads the first)


class Op(Enum):
    INIT = "init"
    Q_G2S = "q_g2s"
    Q_S2R = "q_s2r"
    K_G2S = "k_g2s"
    K_G2S_NEXT = "k_g2s_next"
    K_S2R = "k_s2r"
    QK = "qk"
    SOFTMAX = "softmax"
    V_G2S = "v_g2s"
    V_G2S_NEXT = "v_g2s_next"
    V_S2R = "v_s2r"
    PV = "pv"
    NORMALIZE = "normalize"
    O_R2S = "o_r2s"
    O_S2G = "o_s2g"
    # sm_90a
    SETMAXNREG = "setmaxnreg"  # a warpgroup's register budget (producer down, consumers up)
    RESCALE_O = "rescale_o"  # O *= exp2(m_old - m_new), before the P V that accumulates on it
    CONVERT_P = "convert_p"  # P (fp32) -> 16-bit pairs: the A operand (registers) of P V
    # sm_90a, 8-bit: the producer warps transpose V's raw slot into Vt (P V's K-major B)
    TRANSPOSE_V = "transpose_v"

    @property
    def spelling(self) -> str:
        """The op's name in the printed IR and in hazard descriptions."""
        return self.value

    @property
    def tensor(self) -> Role | None:
        return _INFO[self].tensor

    @property
    def move(self) -> Move:
        return _INFO[self].move

    @property
    def loop_text(self) -> str | None:
        return _INFO[self].loop_text

    @property
    def ahead(self) -> bool:
        return _INFO[self].ahead

    @property
    def twin(self) -> Op | None:
        """The other way to load the same tile: K -> smem <-> K(next) -> smem."""
        return _TWIN.get(self)

    @classmethod
    def of(cls, tensor: Role, move: Move, ahead: bool = False) -> Op:
        """The op that moves ``tensor``'s tile by ``move``."""
        for op, info in _INFO.items():
            if (info.tensor, info.move, info.ahead) == (tensor, move, ahead):
                return op
        raise KeyError((tensor, move, ahead))


_INFO: dict[Op, _Info] = {
    Op.INIT: _Info(None, Move.COMPUTE, None),
    Op.Q_G2S: _Info(Role.Q, Move.G2S, None),
    Op.Q_S2R: _Info(Role.Q, Move.S2R, None),
    Op.K_G2S: _Info(Role.K, Move.G2S, "K -> smem"),
    Op.K_G2S_NEXT: _Info(Role.K, Move.G2S, "K(next) -> smem", ahead=True),
    Op.K_S2R: _Info(Role.K, Move.S2R, "K -> rf"),
    Op.QK: _Info(None, Move.COMPUTE, "S = Q @ K^T"),
    Op.SOFTMAX: _Info(None, Move.COMPUTE, "softmax"),
    Op.V_G2S: _Info(Role.V, Move.G2S, "V -> smem"),
    Op.V_G2S_NEXT: _Info(Role.V, Move.G2S, "V(next) -> smem", ahead=True),
    Op.V_S2R: _Info(Role.V, Move.S2R, "V -> rf"),
    Op.PV: _Info(None, Move.COMPUTE, "O += P @ V"),
    Op.NORMALIZE: _Info(None, Move.COMPUTE, None),
    Op.O_R2S: _Info(Role.O, Move.R2S, None),
    Op.O_S2G: _Info(Role.O, Move.S2G, None),
    Op.SETMAXNREG: _Info(None, Move.COMPUTE, None),
    Op.RESCALE_O: _Info(None, Move.COMPUTE, None),
    Op.CONVERT_P: _Info(None, Move.COMPUTE, None),
    Op.TRANSPOSE_V: _Info(Role.V, Move.S2S, None),
}
_TWIN = {
    Op.K_G2S: Op.K_G2S_NEXT,
    Op.K_G2S_NEXT: Op.K_G2S,
    Op.V_G2S: Op.V_G2S_NEXT,
    Op.V_G2S_NEXT: Op.V_G2S,
}

# Mainloop steps as a spec writes them, in the table's order (for error messages).
LOOP_STEPS: dict[str, Op] = {
    "K -> smem": Op.K_G2S,
    "K(next) -> smem": Op.K_G2S_NEXT,
    "K -> rf": Op.K_S2R,
    "S = Q @ K^T": Op.QK,
    "softmax": Op.SOFTMAX,
    "V -> smem": Op.V_G2S,
    "V(next) -> smem": Op.V_G2S_NEXT,
    "V -> rf": Op.V_S2R,
    "O += P @ V": Op.PV,
}
assert all(op.loop_text == text for text, op in LOOP_STEPS.items())

# The mainloop order when a spec gives none: FlashAttention-2's Kernel 1.
DEFAULT_ORDER = (Op.K_G2S, Op.K_S2R, Op.QK, Op.SOFTMAX, Op.V_G2S, Op.V_S2R, Op.PV)


def fused_reader(tensor: Role) -> Op:
    """The mma that reads ``tensor``'s SMEM tile itself when it is loaded fragment-wise."""
    return Op.QK if tensor in (Role.Q, Role.K) else Op.PV
