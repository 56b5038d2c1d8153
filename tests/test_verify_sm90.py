"""The sm_90a verify pass: the generated kernels' sync plans are proven, and every sync in
them is needed: dropping any one, flipping any parity, dropping any expect_tx, leaving a
wgmma group in flight or shrinking a ring makes verify fail. The brute-force checker agrees
on the real kernels' programs."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from bruteforce_async import explore
from fadsl.ir import Kernel, Parity, Sync
from fadsl.passes.verify_async import AsyncVerifyError
from fadsl.pipeline import compile_file, compile_source
from fadsl.targets.sm90.verify import build_program, verify

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("fa3_*.fa"))
HOPPER = (ROOT / "examples" / "fa3_hopper.fa").read_text()


def _variant(**settings: str) -> str:
    text = HOPPER
    for key, value in settings.items():
        text, n = re.subn(rf"^(\s*){key}\s+\S+", rf"\g<1>{key} {value}", text, flags=re.M)
        assert n == 1, key
    return text


VARIANTS = {
    "pingpong_off": _variant(pingpong="off"),
    "overlap_off": _variant(overlap="off"),
    "both_off": _variant(pingpong="off", overlap="off"),
    "stages_1": _variant(stages="1"),
    "stages_3": _variant(stages="3"),
    "causal": _variant(mask="causal"),
}


def _kernels() -> dict[str, Kernel]:
    kernels = {path.stem: compile_file(path).kernel for path in EXAMPLES}
    kernels.update({name: compile_source(text, name).kernel for name, text in VARIANTS.items()})
    return kernels


KERNELS = _kernels()


def test_the_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"fa3_hopper", "fa3_causal", "fa3_hdim64", "fa3_hdim256"}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_plan_is_proven(name):
    assert verify(KERNELS[name]) is KERNELS[name]


def _mutants(kernel: Kernel):
    """(what, mutant) for every sync: dropped, parity flipped, expect_tx dropped, a wgmma
    wait that leaves one more group in flight."""
    flip = {Parity.PHASE: Parity.PHASE_FLIP, Parity.PHASE_FLIP: Parity.PHASE}
    for phase in ("prologue", "mainloop", "epilogue"):
        items = getattr(kernel, phase)
        for i, item in enumerate(items):
            if not isinstance(item, Sync):
                continue

            def put(new: tuple) -> Kernel:
                return replace(kernel, **{phase: items[:i] + new + items[i + 1 :]})

            yield f"drop {phase} #{i} {item.text()}", put(())
            if item.parity in flip:
                yield f"flip {phase} #{i}", put((replace(item, parity=flip[item.parity]),))
            if item.tx:
                yield f"no expect_tx {phase} #{i}", put((replace(item, tx=0),))
            if item.kind.counted:
                yield f"wait {item.groups + 1} {phase} #{i}", put(
                    (replace(item, groups=item.groups + 1),)
                )


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_hdim64", "both_off", "stages_3", "causal"])
def test_every_sync_is_needed(name):
    survivors = []
    for what, mutant in _mutants(KERNELS[name]):
        try:
            verify(mutant)
        except AsyncVerifyError:
            continue
        survivors.append(what)
    assert survivors == []


@pytest.mark.parametrize("tile", ["K", "V"])
def test_shrinking_a_ring_fails(tile):
    kernel = KERNELS["fa3_hopper"]
    buffers = tuple(replace(b, slots=1) if b.name == tile else b for b in kernel.buffers)
    with pytest.raises(AsyncVerifyError, match=rf"on {tile}\[slot 0\]|on {tile}:"):
        verify(replace(kernel, buffers=buffers))


def test_a_missing_init_is_named():
    kernel = KERNELS["fa3_hopper"]
    prologue = tuple(
        i
        for i in kernel.prologue
        if not (isinstance(i, Sync) and i.barrier == "v_full" and i.count)
    )
    with pytest.raises(AsyncVerifyError, match="mbarrier v_full is used but never initialised"):
        verify(replace(kernel, prologue=prologue))


@pytest.mark.parametrize("name", ["fa3_hopper", "both_off", "stages_1"])
@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_bruteforce_agrees_on_the_generated_plans(name, blocks):
    assert explore(build_program(KERNELS[name], blocks), all_kinds=True) == set()
