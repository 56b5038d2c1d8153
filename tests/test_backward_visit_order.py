"""The host's choice of the deterministic adds' order (fadsl/targets/sm90/backward/host.py,
_in_visit_order): the visit order only where every n-block of a (batch, head) fits on the GPU
at once (a CTA there may wait on a later-launched one), and never with a window, packed
sequences or longest_first; the n-block order (safe whatever runs at once) otherwise."""

from __future__ import annotations

import pytest

import fadsl
from fadsl.targets.sm90.backward import host
from test_gpu_backward import training_spec
from test_gpu_backward_variants import spec_text


class _Device:
    index = 0


@pytest.fixture
def sms(monkeypatch):
    monkeypatch.setattr(host, "sm_count", lambda index: 132)


def _kernel(name: str, *replace: tuple[str, str]):
    text = training_spec(name)
    for old, new in replace:
        assert old in text
        text = text.replace(old, new, 1)
    return fadsl.load(text, verbose=False).compiled.kernel


@pytest.mark.parametrize(
    "name", ["fa3_hopper+deterministic-dqred+s2", "fa3_causal+deterministic-dqred"]
)
def test_deterministic_adds_follow_visits_while_every_n_block_fits(sms, name):
    kernel = _kernel(name)
    assert host._in_visit_order(kernel, 8, _Device())
    assert host._in_visit_order(kernel, 132, _Device())
    assert not host._in_visit_order(
        kernel, 133, _Device()
    )  # a CTA could wait on one not yet placed


def test_the_n_block_order_elsewhere(sms):
    assert not host._in_visit_order(_kernel("fa3_hopper"), 8, _Device())  # not deterministic
    longest = _kernel("fa3_causal+deterministic+longest_first-dqred")
    assert not host._in_visit_order(longest, 8, _Device())  # launches interleave the pairs
    window = fadsl.load(spec_text("window_deterministic"), verbose=False).compiled.kernel
    assert not host._in_visit_order(window, 8, _Device())
