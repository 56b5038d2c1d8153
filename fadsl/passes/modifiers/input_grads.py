"""differentiate_inputs: the score's derivative by each read of a float input (issue 41's
learnable inputs: ALiBi's slopes, a bias table), for the backward and `fadsl explain`.

A pure pass, ``Modifiers -> Modifiers``: ``input_grads`` holds one InputGrad per distinct
read ``x[indices]`` of an f32 input in ``score``, its derivative symbolic and folded as
differentiate_score's is (fadsl/passes/modifiers/derivative.py, ``Wrt``), so that ALiBi's
``s + slopes[h] * (kv_idx - q_idx)`` gives ``kv_idx - q_idx`` by ``slopes[h]`` and a bias
``s + bias[h, kv_idx - q_idx + 64]`` gives ``1.0``. The gradient of the input is then the
sum, over every score of the call and every read, of dS' x derivative added at the read's
indices (dS': the gradient of the modified score), which the backward kernel computes.

``learnable`` says whether an input can have a gradient and, where not, why (and where):
an i32 input, one read only by ``keep`` (a mask has no gradient), one whose read has no
derivative (``floor`` of it), and one whose derivative reads ``s`` (the backward holds P,
not the score, where it has dS': not built).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import Loc
from ...ir.expr import Expr, ExprType, InputGrad, Load, Modifiers, reads_score, walk
from .derivative import NotDifferentiable, Wrt, derivative, index_text


def differentiate_inputs(m: Modifiers) -> Modifiers:
    if m.score is None:
        return m
    floats = {i.name for i in m.inputs if i.dtype is ExprType.F32}
    reads: dict[tuple[str, str], Load] = {}  # the first read of each (input, index text)
    for node in walk(m.score):
        if isinstance(node, Load) and node.input in floats:
            reads.setdefault((node.input, index_text(node)), node)
    grads = []
    for (name, index), read in reads.items():
        try:
            d, why, loc = derivative(m.score, Wrt(name, index)), "", read.loc
        except NotDifferentiable as err:
            d, why, loc = None, str(err), err.loc or read.loc
        grads.append(InputGrad(name, read.indices, d, loc, why))
    return replace(m, input_grads=tuple(grads))


@dataclass(frozen=True)
class Learnable:
    """Whether an input's gradient can be computed; where not, ``why`` (at ``loc``)."""

    ok: bool
    why: str = ""
    loc: Loc | None = None


def learnable(m: Modifiers, name: str) -> Learnable:
    decl = m.input(name)
    if decl is None:
        return Learnable(False, f"the spec declares no input '{name}'")
    if decl.dtype is not ExprType.F32:
        return Learnable(
            False, f"input '{name}' is {decl.dtype.value}: an integer has no gradient", decl.loc
        )
    grads = [g for g in m.input_grads if g.input == name]
    if not grads:
        in_keep = m.keep is not None and _reads(m.keep, name)
        why = (
            "is read only by keep, and a mask has no gradient"
            if in_keep
            else "is read by no score expression, so it has no gradient"
        )
        return Learnable(False, f"input '{name}' {why}", decl.loc)
    for g in grads:
        if g.derivative is None:
            return Learnable(False, f"input '{name}' has no derivative: {g.why}", g.loc)
        if reads_score(g.derivative):
            return Learnable(
                False,
                f"the score's derivative by {name}[{g.index_text()}] reads s, which the backward "
                "no longer holds where it has dS' (it holds P): not built yet",
                g.loc,
            )
    return Learnable(True)


def _reads(e: Expr, name: str) -> bool:
    return any(isinstance(n, Load) and n.input == name for n in walk(e))
