"""The host's choice of the deterministic adds' order (fadsl/targets/sm90/backward/host.py,
_in_visit_order): without a mask the visit order only where every n-block of a (batch, head)
fits on the GPU at once (a CTA there may wait on a later-launched one), causal at any length
(its n-blocks launch last first), and never with a window, packed sequences or longest_first;
the n-block order (safe whatever runs at once) otherwise."""

from __future__ import annotations

import pytest

import fadsl
from fadsl.targets.sm90.backward import host
from training_specs import training_spec
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


def test_deterministic_adds_follow_visits_while_every_n_block_fits(sms):
    kernel = _kernel("fa3_hopper+deterministic-dqred+s2")
    assert host._in_visit_order(kernel, 8, _Device())
    assert host._in_visit_order(kernel, 132, _Device())
    assert not host._in_visit_order(
        kernel, 133, _Device()
    )  # a CTA could wait on one not yet placed


@pytest.mark.parametrize(
    "name", ["fa3_causal+deterministic-dqred", "fa3_hdim64_causal+deterministic+dq_writer-dqred"]
)
def test_causal_deterministic_adds_follow_visits_at_any_length(sms, name):
    """Causal, each wait is on an n-block launched earlier (tests/test_backward_launch_order.py)."""
    kernel = _kernel(name)
    for key_ctas in (1, 8, 132, 133, 4096):
        assert host._in_visit_order(kernel, key_ctas, _Device())


def test_the_n_block_order_elsewhere(sms):
    assert not host._in_visit_order(_kernel("fa3_hopper"), 8, _Device())  # not deterministic
    longest = _kernel("fa3_causal+deterministic+longest_first-dqred")
    assert not host._in_visit_order(longest, 8, _Device())  # launches interleave the pairs
    window = fadsl.load(spec_text("window_deterministic"), verbose=False).compiled.kernel
    assert not host._in_visit_order(window, 8, _Device())
