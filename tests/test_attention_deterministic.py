"""fadsl.attention(..., deterministic=True): the shipped spec's deterministic twin
(fadsl/targets/sm90/variants.py, deterministic_lines). Each head_dim 64 and 128 example's
twin reads back as the block timed fastest in deterministic mode (the training variant the
GPU tests and backward_ab name: tests/training_specs.py), proves its syncs and builds without
spills; head_dim 256 and a window or softcap are refused with a message naming the call's
arguments; a bad flag is a TypeError. The GPU checks (bitwise stable, within the reference):
tests/test_gpu_backward.py, test_public_deterministic_gradients."""

from __future__ import annotations

import pytest
import torch

import fadsl
from fadsl._data import data_dir
from fadsl.pipeline import compile_source
from fadsl.runtime import dispatch
from register_usage import assert_no_spills, kernel_usages
from training_specs import training_spec

# the example -> its fastest deterministic block as a training variant's name
BEST = {
    "fa3_hdim64": "fa3_hdim64+deterministic+dq_writer-dqred+p32+chains2",
    "fa3_hopper": "fa3_hopper+deterministic+dq_writer-dqred+s2",
    "fa3_causal": "fa3_causal+deterministic+dq_writer-dqred+dq_lag",
    "fa3_hdim64_causal": "fa3_hdim64_causal+deterministic+dq_writer-dqred+dq_lag+chains2",
    "fa3_hdim64_causal_short": "fa3_hdim64_causal_short+deterministic+dq_writer-dqred+dq_lag"
    "+chains2",
}


def twin(name: str, causal: bool):
    base = data_dir("examples").joinpath(f"{name}.fa").read_text()
    variant, text = dispatch.attention_variant(name, base, causal, (-1, -1), 0, deterministic=True)
    return variant, fadsl.load(text, verbose=False)


@pytest.mark.parametrize("name", sorted(BEST))
def test_the_twin_is_the_fastest_deterministic_block(name):
    causal = "causal" in name
    variant, kern = twin(name, causal)
    assert variant == f"{name}_{'causal' if causal else 'nomask'}_deterministic"
    best = compile_source(training_spec(BEST[name]), f"{name}.fa").kernel.backward
    found = kern.compiled.kernel.backward
    assert found.text() == best.text(), (name, found.text())
    assert found.deterministic and found.dq_writer


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_hdim64"])
def test_the_twin_builds_without_spills(name):
    _, kern = twin(name, False)
    assert_no_spills(kernel_usages(kern.compiled))


def test_head_dim_256_is_refused_naming_the_flag(hopper):
    for causal in (False, True):
        with pytest.raises(ValueError, match="deterministic=True: .* no deterministic mode"):
            dispatch.attention_kernel(FakeQ(256), causal, (-1, -1), 0.0, True)


class FakeQ:
    """What attention_kernel reads of q: its device, shape (head_dim, seqlen_q)."""

    def __init__(self, head_dim=128, seqlen=4096):
        self.device = torch.device("cuda", 0)
        self.shape = (1, seqlen, 16, head_dim)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))


def test_a_window_or_softcap_with_it_is_refused(hopper):
    with pytest.raises(ValueError, match="deterministic=True with window_size=\\(128, 0\\)"):
        dispatch.attention_kernel(FakeQ(), True, (128, 0), 0.0, True)
    with pytest.raises(ValueError, match="softcap=30"):
        dispatch.attention_kernel(FakeQ(), False, (-1, -1), 30, True)


def test_the_flag_must_be_a_bool(hopper):
    with pytest.raises(TypeError, match="deterministic must be True or False, got 1"):
        dispatch.attention_kernel(FakeQ(), False, (-1, -1), 0.0, 1)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        fadsl.attention(torch.zeros(1, 4, 2, 128), torch.zeros(1, 4, 2, 128),
                        torch.zeros(1, 4, 2, 128), deterministic="yes")  # fmt: skip


def test_the_plain_call_keeps_the_shipped_kernel(hopper):
    plain = dispatch.attention_kernel(FakeQ(), False, (-1, -1), 0.0)
    det = dispatch.attention_kernel(FakeQ(), False, (-1, -1), 0.0, True)
    assert plain.config.name == "fa3_hopper"
    assert not plain.compiled.kernel.backward.deterministic
    assert det.config.name == "fa3_hopper_nomask_deterministic"
    assert det.compiled.kernel.backward.deterministic
    assert dispatch.attention_kernel(FakeQ(), False, (-1, -1), 0.0, True) is det  # cached


def test_the_flag_is_checked_without_gradients_too():
    # (a forward-only call runs the plain forward, but the refusal must not depend on it)
    t = torch.zeros(1, 4, 2, 128)
    with pytest.raises(ValueError, match="deterministic=True with window_size=\\(128, 0\\)"):
        fadsl.attention(t, t, t, window_size=(128, 0), deterministic=True)
    with pytest.raises(ValueError, match="softcap=30"):
        fadsl.attention(t, t, t, softcap=30, deterministic=True)


def test_a_bad_window_keeps_its_own_message(hopper):
    with pytest.raises(ValueError) as err:
        dispatch.attention_kernel(FakeQ(), False, (-5, 2), 0.0)
    assert str(err.value).startswith("window_size must hold -1")
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        dispatch.attention_kernel(FakeQ(), False, 5, 0.0)
