"""The sm_90a sync plans' mutants (tests/test_verify_sm90.py, tests/test_fp8_plan.py): every
sync dropped, every parity flipped, a per-tile parity made ZERO, an expect_tx without its
bytes, a wait that leaves one more group in flight; and the mutants verify does not refuse."""

from __future__ import annotations

from dataclasses import replace

from fadsl.ir import Kernel, Parity, Sync
from fadsl.passes.asyncmodel.prove import AsyncVerifyError
from fadsl.targets.sm90.verify import verify

_FLIPS = {
    Parity.PHASE: Parity.PHASE_FLIP,
    Parity.PHASE_FLIP: Parity.PHASE,
    Parity.TILE: Parity.TILE_FLIP,
    Parity.TILE_FLIP: Parity.TILE,
}


def mutants(kernel: Kernel):
    """(what, mutant) for every sync: dropped, parity flipped, a per-tile parity made ZERO,
    expect_tx dropped, a wgmma wait that leaves one more group in flight."""
    for phase in ("prologue", "mainloop", "epilogue"):
        items = getattr(kernel, phase)
        for i, item in enumerate(items):
            if not isinstance(item, Sync):
                continue

            def put(new: tuple) -> Kernel:
                return replace(kernel, **{phase: items[:i] + new + items[i + 1 :]})

            yield f"drop {phase} #{i} {item.text()}", put(())
            if item.parity in _FLIPS:
                yield f"flip {phase} #{i} {item.text()}", put(
                    (replace(item, parity=_FLIPS[item.parity]),)
                )
            if item.parity in (Parity.TILE, Parity.TILE_FLIP):
                yield f"zero {phase} #{i} {item.text()}", put((replace(item, parity=Parity.ZERO),))
            if item.tx:
                yield f"no expect_tx {phase} #{i}", put((replace(item, tx=0),))
            if item.kind.counted:
                yield f"wait {item.groups + 1} {phase} #{i}", put(
                    (replace(item, groups=item.groups + 1),)
                )


def survivors(kernel: Kernel) -> list[str]:
    found = []
    for what, mutant in mutants(kernel):
        try:
            verify(mutant)
        except AsyncVerifyError:
            continue
        found.append(what)
    return found
