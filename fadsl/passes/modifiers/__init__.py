"""The passes over a spec's score and mask modifiers (issue 41), each a pure function
``Modifiers -> Modifiers`` in its own module, run in the order ``MODIFIER_PASSES`` lists:

1. check_modifiers (check.py): names resolved, types inferred, indices and functions
   proven safe; every problem a located error (SpecError);
2. derive_sparsity (sparsity.py): `keep`'s tile classes (FULL, EMPTY, PARTIAL) as a rule
   over a tile's bounds, by interval arithmetic;
3. differentiate_score (derivative.py): d score / d s, symbolically (for explain now, for
   the backward of step 4);
4. differentiate_inputs (input_grads.py): the score's derivative by each read of a float
   input (the gradients of learnable inputs: ALiBi's slopes, a bias table);
5. split_distance_term (distance.py): a score ``s + f`` whose ``f`` reads the indices only as
   their distance, and is dear to evaluate (a target evaluates it once a distance).

The front end runs them (fadsl/frontend/modifiers.py) so that their errors are reported
with the spec's other ones.
"""

from __future__ import annotations

from typing import Callable

from ...ir.expr import Modifiers
from .check import check_modifiers
from .derivative import differentiate_score
from .distance import split_distance_term
from .input_grads import differentiate_inputs
from .sparsity import derive_sparsity

MODIFIER_PASSES: tuple[tuple[str, Callable[[Modifiers], Modifiers]], ...] = (
    ("check_modifiers", check_modifiers),
    ("derive_sparsity", derive_sparsity),
    ("differentiate_score", differentiate_score),
    ("differentiate_inputs", differentiate_inputs),
    ("split_distance_term", split_distance_term),
)


def run_modifier_passes(modifiers: Modifiers) -> Modifiers:
    """The modifiers through every pass, in order (a SpecError from the first that refuses)."""
    for _name, run in MODIFIER_PASSES:
        modifiers = run(modifiers)
    return modifiers
