"""Kernels up to (not through) verify, and a hand-made tile-loop plan for tests of verify.

``unverified`` runs every pass but verify, so a test can hand verify a plan it refuses.
``persistent`` turns the single-tile plan (insert_syncs before the persistent scheduler:
q_full waited at parity 0, nothing freeing Q, O or the last V slot between tiles) into a plan
for a CTA that runs many tiles, written here by hand, apart from insert_syncs:
- q_empty (one arrival per consumer warp, after the tile's last wgmma.wait_group): the
  producer waits it at parity tile^1 before loading the next tile's Q;
- o_free (one arrival per consumer warpgroup, after its TMA store has read O): the producer
  waits it at parity tile^1 before each V load (V's ring shares its bytes with O);
- the producer's prologue waits k_empty for its K block (the ring goes on across tiles), and
  the consumers release the tile's last V block in the epilogue;
- the consumers wait q_full at parity tile.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fadsl import targets
from fadsl.errors import Loc
from fadsl.ir import Kernel, Parity, Phase, Sync, Threads
from fadsl.pipeline import front_end
from fadsl.targets.sm90 import caps

ROOT = Path(__file__).resolve().parents[1]
SM90_SPECS = sorted(ROOT.glob("examples/fa3_*.fa")) + sorted(ROOT.glob("tests/specs/sm90/*.fa"))


def unverified(source: str, file: str = "<spec>") -> Kernel:
    """The kernel after every pass before verify."""
    kernel = front_end(source, file)
    target = targets.target_of(kernel)
    for name, run in target.passes:
        if name == "verify":
            return kernel
        kernel = run(kernel, target)
    raise AssertionError("the target has no verify pass")


def _sync(kind, phase: Phase, who: Threads, barrier: str, note: str, **more) -> Sync:
    return Sync(
        kind, phase, (), Loc("<persistent_plan>", 0, 0), who=who, barrier=barrier, note=note, **more
    )


def persistent(kernel: Kernel) -> Kernel:
    """The single-tile plan of ``kernel`` made safe for a sequence of tiles (see above)."""
    hopper = kernel.config.hopper
    assert hopper is not None
    p, m, e = Phase.PROLOGUE, Phase.MAINLOOP, Phase.EPILOGUE
    prologue: list = []
    for item in kernel.prologue:
        if isinstance(item, Sync) and item.kind is caps.FENCE_MBAR_INIT:
            for name, count in (("q_empty", 4 * hopper.consumers), ("o_free", hopper.consumers)):
                prologue.append(
                    _sync(caps.MBAR_INIT, p, Threads.THREAD0, name, "init", count=count)
                )
        if isinstance(item, Sync) and item.kind is caps.MBAR_EXPECT_TX and item.barrier == "q_full":
            prologue.append(
                _sync(
                    caps.MBAR_WAIT,
                    p,
                    Threads.PRODUCER_THREAD,
                    "q_empty",
                    "Q free",
                    parity=Parity.TILE_FLIP,
                )
            )
        if isinstance(item, Sync) and item.kind is caps.MBAR_EXPECT_TX and item.barrier == "k_full":
            prologue.append(
                _sync(
                    caps.MBAR_WAIT,
                    p,
                    Threads.PRODUCER_THREAD,
                    "k_empty",
                    "K slot free",
                    lag=item.lag,
                    parity=Parity.PHASE_FLIP,
                )
            )
        if isinstance(item, Sync) and item.kind is caps.MBAR_WAIT and item.barrier == "q_full":
            item = replace(item, parity=Parity.TILE)
        prologue.append(item)

    def before_v_waits(items: tuple, phase: Phase) -> list:
        out: list = []
        for item in items:
            if isinstance(item, Sync) and item.kind is caps.MBAR_WAIT and item.barrier == "v_empty":
                out.append(
                    _sync(
                        caps.MBAR_WAIT,
                        phase,
                        Threads.PRODUCER_THREAD,
                        "o_free",
                        "O stored",
                        parity=Parity.TILE_FLIP,
                    )
                )
            out.append(item)
        return out

    mainloop = before_v_waits(kernel.mainloop, m)
    epilogue = before_v_waits(kernel.epilogue, e)
    waits = [
        i
        for i, item in enumerate(epilogue)
        if isinstance(item, Sync) and item.kind is caps.WGMMA_WAIT and item.who is Threads.CONSUMERS
    ]
    v_lag = next(s.lag for s in kernel.syncs() if s.barrier == "v_empty" and s.lag is not None)
    epilogue[waits[-1] + 1 : waits[-1] + 1] = [
        _sync(caps.MBAR_ARRIVE, e, Threads.CONSUMER_WARP_LANE0, "q_empty", "Q read"),
        _sync(
            caps.MBAR_ARRIVE, e, Threads.CONSUMER_WARP_LANE0, "v_empty", "last V read", lag=v_lag
        ),
    ]
    bulk = next(
        i
        for i, item in enumerate(epilogue)
        if isinstance(item, Sync) and item.kind is caps.BULK_WAIT
    )
    epilogue.insert(
        bulk + 1, _sync(caps.MBAR_ARRIVE, e, Threads.CONSUMER_ELECTED, "o_free", "O read")
    )
    return replace(
        kernel, prologue=tuple(prologue), mainloop=tuple(mainloop), epilogue=tuple(epilogue)
    )
