"""fadsl.attention's sliding window and softcap, without a GPU: the variant of each shipped
sm_90a example a call's window_size and softcap select (fadsl/runtime/dispatch.py,
attention_variant), that each compiles with its backward where the example has one, and
the errors that name the argument. The GPU runs them in tests/test_gpu_attention_variants.py."""

from __future__ import annotations

from dataclasses import replace

import re

import pytest
import torch

from fadsl import targets
from fadsl._data import data_dir
from fadsl.build.spill_check import check_registers, find_compiler
from fadsl.errors import SpecError
from fadsl.pipeline import compile_source, front_end
from fadsl.runtime import dispatch
from fadsl.runtime.dispatch import attention_variant

SM90 = sorted(targets.get("sm_90a").shipped.items())
# (window_size, softcap) as FlashAttention takes them: two-sided, left-only, right-only with
# the other side unbounded, a cap alone, a window and a cap
CALLS = [((128, 64), 0), ((256, -1), 0), ((-1, 100), 0), ((-1, -1), 30), ((200, 0), 50.0)]


def variant(name: str, causal: bool, window_size, softcap):
    base = data_dir("examples").joinpath(f"{name}.fa").read_text()
    return attention_variant(name, base, causal, window_size, softcap)


@pytest.mark.parametrize("key, name", SM90, ids=[n for _, n in SM90])
@pytest.mark.parametrize("window_size, softcap", CALLS)
def test_each_variant_compiles_with_its_mask_softcap_and_backward(key, name, window_size, softcap):
    head_dim, causal = key
    variant_name, text = variant(name, causal, window_size, softcap)
    kernel = compile_source(text, f"{variant_name}.fa").kernel
    config = kernel.config
    assert config.name == variant_name and config.head_dim == head_dim
    assert config.features.softcap == int(softcap)
    left, right = window_size
    if left < 0 and (causal or right < 0):
        assert config.window is None
    else:
        assert config.window is not None
        assert config.window.left == (left if left >= 0 else dispatch.MAX_WINDOW)
        assert config.window.right == (
            0 if causal else right if right >= 0 else dispatch.MAX_WINDOW
        )
        assert config.ext.cluster == 1 and "smem[cluster]" not in text.split("backward {")[0]
    assert (config.mask.value == "causal") == causal
    base = compile_source(data_dir("examples").joinpath(f"{name}.fa").read_text(), "b.fa")
    if base.kernel.backward is None:
        assert kernel.backward is None
        return
    bwd = kernel.backward
    if softcap and head_dim == 256:  # its own tile fits the cap: the example's block
        assert bwd.text() == base.kernel.backward.text()
    elif softcap:  # 1 - tanh^2 per score: B_r 64, dS stored as at B_r 64
        assert (bwd.block_m, bwd.early_dv, bwd.overlap) == (64, False, causal)
        assert config.block_r == 64 * config.ext.consumers and config.ext.consumers <= 2
    elif config.window is not None:  # the example's own block without `peel_dead` (refused)
        assert bwd.text() == replace(base.kernel.backward, peel_dead=False).text()
    else:  # the example's own block
        assert bwd.text() == base.kernel.backward.text()


def test_variant_names_differ_by_call_and_fit_a_kernel_name():
    names = {variant("fa3_hopper", False, w, s)[0] for w, s in CALLS}
    assert len(names) == len(CALLS)
    assert all(len(n) <= dispatch.MAX_NAME and re.fullmatch(r"\w+", n) for n in names)


def test_the_defaults_run_the_example_itself(monkeypatch):
    picked = []
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(dispatch, "_shipped", lambda name: picked.append(name) or name)
    q = torch.empty(1, 8, 2, 128)
    assert dispatch.attention_kernel(q, False) == "fa3_hopper"
    assert dispatch.attention_kernel(q, True, [-1, -1], 0) == "fa3_causal"
    assert picked == ["fa3_hopper", "fa3_causal"]


def test_a_target_without_windows_names_the_arguments(monkeypatch):
    """sm_80's kernels have no sliding window or softcap: the call says which arguments, not
    a spec error about a file the user never wrote."""
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    q = torch.empty(1, 8, 2, 128)
    with pytest.raises(
        ValueError, match=r"window_size=\(64, 0\), softcap=0: the shipped spec fa2_pipelined"
    ):
        dispatch.attention_kernel(q, False, (64, 0), 0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a pair of ints"),
        (dict(window_size=(1.5, 2)), TypeError, r"window_size must be a pair of ints"),
        (dict(window_size=(-5, 2)), ValueError, r"window_size must hold -1 \(unbounded\)"),
        (dict(softcap="x"), TypeError, r"softcap must be a number"),
        (dict(softcap=2.5), ValueError, r"softcap must be 0 or a whole number from 1 to 1000"),
    ],
)
def test_bad_windows_and_caps_are_named(kwargs, error, message, monkeypatch):
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    q = torch.empty(1, 8, 2, 128)
    window_size = kwargs.get("window_size", (-1, -1))
    softcap = kwargs.get("softcap", 0)
    with pytest.raises(error, match=message):
        dispatch.attention_kernel(q, False, window_size, softcap)


def test_a_spec_error_of_a_variant_is_not_swallowed_elsewhere():
    """attention_variant's text is a spec: a broken rewrite would be a located SpecError."""
    _, text = variant("fa3_hopper", False, (128, 64), 30)
    with pytest.raises(SpecError):
        compile_source(text.replace("mask       window", "mask       windo"), "w.fa")


# One variant of each kind that fits its registers only as attention_variant writes it
FITS = [
    ("fa3_hopper", False, (-1, 100), 50),  # two-sided window and cap, the plain order
    ("fa3_causal", True, (-1, -1), 30),  # causal and cap, the overlapped order
    ("fa3_hdim64", False, (128, 64), 30),  # head_dim 64's forward at 2 consumers
    ("fa3_hdim256_causal", True, (-1, -1), 30),  # head_dim 256's backward as the example has it
]


@pytest.mark.parametrize("name, causal, window_size, softcap", FITS, ids=[f[0] for f in FITS])
def test_the_capped_variants_build_without_spills(name, causal, window_size, softcap):
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(why)
    variant_name, text = variant(name, causal, window_size, softcap)
    check = check_registers(compile_source(text, f"{variant_name}.fa"), compiler, why)
    assert check.rows and not check.allowed_spills


def test_the_target_says_which_lines_a_window_or_a_softcap_needs():
    """Target.variant_lines (sm_90a's, fadsl/targets/sm90/variants.py) reads the compiled
    spec: a window takes CTA pairs apart (K and V per CTA) and split tiles off; a softcap
    takes 3 consumers to 2 and the backward to B_r 64 with dS stored, in the order the mask
    fits; a plain spec or no window and no cap needs nothing."""
    lines_of = targets.get("sm_90a").variant_lines

    def kernel(name):
        return front_end(data_dir("examples").joinpath(f"{name}.fa").read_text(), f"{name}.fa")

    hopper = lines_of(kernel("fa3_hopper"), True, False, False)  # cluster 2 in the example
    assert hopper.settings == {"cluster": "1"} and hopper.scopes == {"K": "cta", "V": "cta"}
    assert not hopper.backward
    hdim64 = lines_of(kernel("fa3_hdim64"), True, True, True)  # tail split_kv, 3 consumers
    assert hdim64.settings == {
        "tail": "whole",
        "tile": "B_r = 128, B_c = 128",
        "warpgroups": "producer = 1, consumers = 2",
        "registers": "producer = 24, consumers = 240",
    }
    assert hdim64.backward == {
        "tile": "B_r = 64, B_c = 128",
        "early_dv": "off",
        "dq_lag": "off",  # (a softcap keeps the meeting: SOFTCAP_BACKWARD)
        "dq_first": "off",  # (which orders the lag)
        "overlap": "on",
    }
    assert hdim64.backward_paths == {
        "dS": "rf -st.shared-> smem[cta] -wgmma-> rf",
        "dK": "rf -st.global-> gmem",  # (their TMA path is the lagged consumer's)
        "dV": "rf -st.global-> gmem",
    }
    causal = lines_of(kernel("fa3_causal"), False, True, False)  # 2 consumers already
    assert not causal.settings and causal.backward["overlap"] == "off"
    plain = lines_of(kernel("fa3_causal"), False, False, True)
    assert not (plain.settings or plain.scopes or plain.backward or plain.backward_paths)
