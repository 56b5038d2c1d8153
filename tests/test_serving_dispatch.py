"""fadsl.attention_varlen and fadsl.attention_with_kvcache without a GPU (issue 31): which shipped
serving spec a call gets (Target.shipped_serving), the lines a call rewrites on it (mask,
window, softcap, the cache's layout, PackGQA, splits), that every such variant passes the
front end and the proof (and nvcc, without spills, for the ones not GPU-tested as written),
and the errors that name the argument."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fadsl
from fadsl import targets
from fadsl.build.nvrtc import nvcc
from fadsl.codegen.render import write
from fadsl.frontend.rewrite import rewrite
from fadsl.pipeline import compile_source
from fadsl.runtime.dispatch import (
    LONG_CAUSAL_ROWS,
    kvcache_settings,
    serving_settings,
    shipped_serving_spec,
    variant_name,
    varlen_schedule,
)

from test_sm90_codegen import builds_without_spills

ROOT = Path(__file__).resolve().parent.parent
SERVING = ROOT / "examples" / "serving"
PAGES = targets.get("sm_90a").page_sizes  # the page sizes the serving spec takes
SHIPPED = [
    (name, key, spec)
    for name in targets.names()
    for key, spec in targets.get(name).shipped_serving.items()
]


def _variant(kind: str, head_dim: int, settings: dict[str, str]):
    name = shipped_serving_spec(kind, (9, 0), head_dim)
    text = rewrite((SERVING / f"{name}.fa").read_text(), settings, {}, variant_name(name, settings))
    return compile_source(text, f"{variant_name(name, settings)}.fa")


@pytest.mark.parametrize("target, key, spec", SHIPPED, ids=[s for _, _, s in SHIPPED])
def test_each_shipped_serving_spec_serves_its_call_and_head_dim(target, key, spec):
    config = compile_source((SERVING / f"{spec}.fa").read_text(), f"{spec}.fa").kernel.config
    kind, head_dim = key
    assert (config.target, config.head_dim) == (target, head_dim)
    if kind == "varlen":
        assert config.ext.varlen
    else:
        assert config.ext.kv_cache is not None and config.ext.kv_cache >= 0


def test_the_head_dim_picks_the_serving_spec_and_what_none_covers_is_named():
    assert shipped_serving_spec("varlen", (9, 0), 64) == "fa3_varlen_hdim64"
    assert shipped_serving_spec("varlen", (9, 0), 128) == "fa3_varlen_causal"
    assert shipped_serving_spec("kvcache", (9, 0), 128) == "fa3_decode_paged"
    with pytest.raises(ValueError, match=r"head_dim\) = 64: fadsl.attention_with_kvcache .*128"):
        shipped_serving_spec("kvcache", (9, 0), 64)
    with pytest.raises(
        ValueError, match=r"attention_varlen ships no spec .* 8.0 \(head_dim none\)"
    ):
        shipped_serving_spec("varlen", (8, 0), 128)  # sm_80 has no varlen kernel


@pytest.mark.parametrize(
    "causal, window, softcap, expected",
    [
        (False, (-1, -1), 0, {"mask": "none"}),
        (True, (-1, -1), 0, {"mask": "causal"}),
        (True, (256, 0), 0, {"mask": "causal, window(256)"}),
        (True, (256, -1), 0, {"mask": "causal, window(256)"}),
        (False, (100, 30), 0, {"mask": "window(100, 30)"}),
        (False, (0, 0), 0, {"mask": "window(0, 0)"}),
        (True, (-1, -1), 30, {"mask": "causal", "softcap": "30"}),
        (False, (-1, -1), 50.0, {"mask": "none", "softcap": "50"}),
        # as FlashAttention: causal puts the right side at 0; -1 leaves a side open
        (True, (10, 5), 0, {"mask": "causal, window(10)"}),
        (True, (-1, 5), 0, {"mask": "causal"}),
        (False, (10, -1), 0, {"mask": "window(10, 16777216)"}),
        (False, (-1, 3), 0, {"mask": "window(16777216, 3)"}),
    ],
)
def test_mask_window_and_softcap_become_spec_lines(causal, window, softcap, expected):
    assert serving_settings(causal, window, softcap) == expected


@pytest.mark.parametrize(
    "causal, window, softcap, error, message",
    [
        (1, (-1, -1), 0, TypeError, r"causal must be True or False, got 1"),
        (False, (5,), 0, TypeError, r"window_size must be a pair of ints"),
        (False, (5.0, 1), 0, TypeError, r"window_size must be a pair of ints"),
        (False, (-2, 0), 0, ValueError, r"window_size must hold -1 .* got \(-2, 0\)"),
        (True, ((1 << 24) + 1, 0), 0, ValueError, r"sizes 0 to 16777216, got \(16777217, 0\)"),
        (False, (-1, -1), 2.5, ValueError, r"softcap must be 0 or a whole number .* got 2.5"),
        (False, (-1, -1), 5000, ValueError, r"softcap must be 0 or a whole number"),
        (False, (-1, -1), float("inf"), ValueError, r"softcap must be 0 or a whole number"),
        (False, (-1, -1), float("nan"), ValueError, r"softcap must be 0 or a whole number"),
        (False, (-1, -1), -30, ValueError, r"softcap must be 0 or a whole number"),
        (False, (-1, -1), True, TypeError, r"softcap must be a number, got bool"),
    ],
)
def test_bad_mask_arguments_are_named(causal, window, softcap, error, message):
    with pytest.raises(error, match=message):
        serving_settings(causal, window, softcap)


def test_the_cache_and_heads_pick_layout_packing_and_splits():
    contiguous = torch.zeros(2, 1024, 8, 128)
    paged = torch.zeros(40, 16, 8, 128)
    table = torch.zeros(2, 20, dtype=torch.int32)
    assert kvcache_settings(contiguous, None, 32, False, PAGES) == {
        "kv_cache": "contiguous",
        "pack_gqa": "on",
        "splits": "auto",
    }
    assert kvcache_settings(paged, table, 32, False, PAGES)["kv_cache"] == "paged(16)"
    assert (
        kvcache_settings(paged, table, 24, False, PAGES)["pack_gqa"] == "off"
    )  # 3 does not divide 64
    assert kvcache_settings(paged, table, 7, False, PAGES)["pack_gqa"] == "off"  # not a multiple
    assert kvcache_settings(paged, table, 32, True, PAGES) == {
        "kv_cache": "paged(16)",
        "pack_gqa": "off",
        "splits": "off",
    }
    with pytest.raises(ValueError, match=r"k_cache.shape\[1\] \(the page size\) = 48"):
        kvcache_settings(torch.zeros(4, 48, 8, 128), table, 32, False, PAGES)
    with pytest.raises(ValueError, match=r"k_cache must be a 4-D tensor"):
        kvcache_settings(torch.zeros(4, 48, 128), table, 32, False, PAGES)


# Every line a call may set, on each serving spec: each variant passes the checks and the proof
VARIANTS = [
    ("varlen", 128, {"mask": "none"}),
    ("varlen", 128, {"mask": "causal, window(256)", "softcap": "30"}),
    ("varlen", 64, {"mask": "causal"}),
    ("varlen", 64, {"mask": "window(100, 30)"}),
    ("varlen", 128, {"mask": "causal", "scheduler": "grid"}),
    ("varlen", 64, {"mask": "causal", "scheduler": "grid"}),
    ("varlen", 128, {"mask": "causal", "softcap": "30", "scheduler": "grid"}),
    ("varlen", 64, {"mask": "causal", "softcap": "30", "scheduler": "grid"}),
    ("kvcache", 128, {"mask": "none", "kv_cache": "paged(16)", "pack_gqa": "on", "splits": "auto"}),
    ("kvcache", 128, {"mask": "causal", "kv_cache": "paged(32)", "pack_gqa": "on", "splits": "auto"}),
    ("kvcache", 128, {"mask": "causal", "kv_cache": "paged(128)", "pack_gqa": "off", "splits": "auto"}),
    ("kvcache", 128, {"mask": "causal", "kv_cache": "paged(256)", "pack_gqa": "on", "splits": "auto"}),
    ("kvcache", 128, {"mask": "causal", "kv_cache": "contiguous", "pack_gqa": "on", "splits": "auto", "softcap": "30"}),
    ("kvcache", 128, {"mask": "causal, window(512)", "kv_cache": "paged(64)", "pack_gqa": "off", "splits": "off"}),
    ("kvcache", 128, {"mask": "window(40, 2)", "kv_cache": "paged(64)", "pack_gqa": "off", "splits": "off"}),
    ("kvcache", 128, {"mask": "causal", "kv_cache": "paged(64)", "pack_gqa": "off", "splits": "auto"}),
]  # fmt: skip
VARIANT_IDS = [variant_name(f"{kind}{d}", s) for kind, d, s in VARIANTS]
# the variants the GPU tests do not run as written (they run the grid ones without softcap)
SPILL_CHECKED = (1, 2, 6, 7, 8, 11, 13, 14, 15)


@pytest.mark.parametrize("kind, head_dim, settings", VARIANTS, ids=VARIANT_IDS)
def test_every_line_a_call_sets_gives_a_proven_kernel(kind, head_dim, settings):
    config = _variant(kind, head_dim, settings).kernel.config
    assert config.mask_text == settings["mask"]
    assert config.ext.persistent == (settings.get("scheduler", "persistent") == "persistent")
    assert config.ext.softcap == int(settings.get("softcap", 0))
    if kind == "kvcache":
        page = re.match(r"paged\((\d+)\)", settings["kv_cache"])
        assert config.ext.kv_cache == (int(page[1]) if page else 0)
        assert config.ext.pack_gqa == (settings["pack_gqa"] == "on")
        assert config.ext.split_all == (settings["splits"] == "auto")


@pytest.mark.parametrize(
    "mask, max_seqlen_q, expected",
    [
        ("causal", 8192, {"scheduler": "grid"}),
        ("causal", 100000, {"scheduler": "grid"}),
        ("causal", 8191, {}),  # the threshold's other side
        ("causal", None, {}),  # not given: the spec's own
        ("causal", 8192.0, {}),  # not an int (checked by name later)
        ("none", 16384, {}),
        ("causal, window(256)", 16384, {}),
        ("window(100, 30)", 16384, {}),
    ],
)
def test_a_long_causal_varlen_batch_runs_a_cta_per_tile(mask, max_seqlen_q, expected):
    assert varlen_schedule(mask, max_seqlen_q) == expected
    assert LONG_CAUSAL_ROWS == 8192


def test_variant_names_spell_their_settings():
    settings = {"mask": "causal, window(512)", "kv_cache": "paged(16)", "pack_gqa": "off"}
    assert (
        variant_name("fa3_decode_paged", settings) == "fa3_decode_paged_causal_window_512_paged_16"
    )
    settings = {"mask": "none", "kv_cache": "contiguous", "pack_gqa": "on", "splits": "auto"}
    assert variant_name("fa3_decode_paged", settings) == (
        "fa3_decode_paged_nomask_contiguous_pack_splits"
    )
    settings = {"mask": "window(100000, 100000)", "softcap": "1000", "kv_cache": "contiguous"}
    settings.update(pack_gqa="on", splits="auto")
    long = variant_name("fa3_decode_paged", settings)
    assert len(long) == 64 and re.fullmatch(r"[A-Za-z_]\w*", long)
    assert long != variant_name("fa3_decode_paged", {**settings, "softcap": "999"})


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "kind, head_dim, settings",
    [VARIANTS[i] for i in SPILL_CHECKED],
    ids=[VARIANT_IDS[i] for i in SPILL_CHECKED],
)
def test_call_variants_compile_without_spills(kind, head_dim, settings):
    """The variants the GPU tests do not run as written: nvcc builds them without a spill."""
    compiled = _variant(kind, head_dim, settings)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for cu in write(compiled.kernel, compiled.target, compiled.file, out):
            if cu.suffix == ".cu" and "fp16" not in cu.name:  # (one dtype: the same registers)
                builds_without_spills(cu, out)


def test_serving_calls_check_q_by_name_before_any_gpu_is_asked():
    q = torch.zeros(8, 2, 64)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got list"):
        fadsl.attention_varlen([1], q, q, q, q)
    with pytest.raises(ValueError, match=r"q must be 3-d \(tokens, heads, head_dim\)"):
        fadsl.attention_varlen(q[None], q, q, q, q)
    with pytest.raises(ValueError, match=r"q must be on a CUDA device, got cpu"):
        fadsl.attention_varlen(q, q, q, q, q)
    with pytest.raises(ValueError, match=r"q must be 4-d \(batch, seqlen, heads, head_dim\)"):
        fadsl.attention_with_kvcache(q, q, q, q)
    with pytest.raises(ValueError, match=r"q must be on a CUDA device, got cpu"):
        fadsl.attention_with_kvcache(q[None], q, q, q)


def test_a_bad_argument_is_named_before_new_tokens_are_written(monkeypatch):
    """attention_with_kvcache checks every argument (the kernel's own checks) before it
    appends k and v to the cache: a refused call leaves the cache as it was."""
    from types import SimpleNamespace

    from fadsl.runtime import append, dispatch, public

    calls = []

    class Refusing:
        def __init__(self, windowed: bool) -> None:
            self.config = SimpleNamespace(window=object() if windowed else None)

        def check_kvcache_call(self, *args):
            calls.append("checked")
            raise ValueError("softmax_scale must be finite and positive, got -1")

    monkeypatch.setattr(public, "check_q", lambda q, dims, shape: None)
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(
        dispatch, "_serving_kernel", lambda kind, q, s: Refusing("window" in s["mask"])
    )
    monkeypatch.setattr(append, "launch_append", lambda *args: calls.append("appended"))
    cache = torch.zeros(2, 64, 8, 128)
    new = torch.zeros(2, 1, 8, 128)
    q = torch.zeros(2, 1, 32, 128)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        fadsl.attention_with_kvcache(q, cache, cache, None, new, new, softmax_scale=-1)
    assert calls == ["checked"]
    with pytest.raises(ValueError, match=r"k and v: give the new tokens' keys and values both"):
        fadsl.attention_with_kvcache(q, cache, cache, None, new, None)
    with pytest.raises(ValueError, match=r"num_splits=4 with a sliding window"):
        fadsl.attention_with_kvcache(q, cache, cache, None, window_size=(64, 0), num_splits=4)
    assert calls == ["checked"]  # neither reached the kernel's checks nor the append


def test_a_call_after_the_first_finds_its_kernel_with_one_lookup(monkeypatch):
    """The serving calls remember the kernel a call's arguments chose: the second call with
    the same arguments loads nothing; a bool never passes for the int it equals."""
    from fadsl.runtime import dispatch

    chosen = []
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(
        dispatch, "_serving_kernel", lambda kind, q, s: chosen.append(s) or object()
    )
    q = torch.zeros(2, 1, 32, 128)
    cache = torch.zeros(4, 64, 8, 128)
    table = torch.zeros(2, 2, dtype=torch.int32)
    first = dispatch.kvcache_kernel(q, cache, table, True, (-1, -1), 0)
    assert dispatch.kvcache_kernel(q, cache, table, True, [-1, -1], 0) is first
    assert len(chosen) == 1 and chosen[0]["kv_cache"] == "paged(64)"
    assert dispatch.kvcache_kernel(q, cache, None, True, (-1, -1), 0) is not first
    assert chosen[-1]["kv_cache"] == "contiguous"
    with pytest.raises(TypeError, match="softcap must be a number"):
        dispatch.kvcache_kernel(q, cache, table, True, (-1, -1), False)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        dispatch.kvcache_kernel(q, cache, table, True, (True, -1), 0)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        dispatch.kvcache_kernel(q, cache, table, True, ([1], -1), 0)
    packed = torch.zeros(8, 32, 128)
    long = dispatch.varlen_kernel(packed, True, (-1, -1), 0, 1 << 20)
    assert chosen[-1].get("scheduler") == "grid"
    assert dispatch.varlen_kernel(packed, True, (-1, -1), 0, None) is not long
    assert dispatch.varlen_kernel(packed, True, (-1, -1), 0, 1 << 21) is long


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 1 << 26),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.tuples(st.integers(-3, 1 << 25), st.integers(-3, 1 << 25)),
    st.lists(st.integers(-2, 300), max_size=3),
)


@settings(max_examples=200, deadline=None)
@given(causal=_ANY, window=_ANY, softcap=_ANY)
def test_any_mask_arguments_give_lines_or_a_named_error(causal, window, softcap):
    """Whatever a caller passes for causal, window_size and softcap: spec lines the front end
    reads back, or a TypeError / ValueError naming the argument; never another exception."""
    try:
        lines = serving_settings(causal, window, softcap)
    except (TypeError, ValueError) as err:
        assert re.match(r"(causal|window_size|softcap) ", str(err)), err
        return
    assert set(lines) <= {"mask", "softcap"}
    note(repr(lines))
    config = _variant("varlen", 128, lines).kernel.config
    assert config.mask_text == lines["mask"]


def test_the_numbers_that_choose_a_kernel_are_read_by_value():
    """Under torch.compile a window's sides, the softcap and num_splits may reach the ops'
    fakes as SymInt or SymFloat: they are specialised to their values (a bool stays a bool,
    so that the checks still refuse it)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fadsl.runtime.public_ops import concrete

    env = ShapeEnv()
    left = env.create_symintnode(env.create_symbol(64, ConstantSource("left")), hint=64)
    cap = env.create_symfloatnode(
        env.create_unspecified_symbol(30.0, ConstantSource("cap")), hint=30.0
    )
    assert concrete(left, 0, None, cap, True) == (64, 0, None, 30.0, True)
    assert type(concrete(left)[0]) is int and type(concrete(cap)[0]) is float


def test_the_op_paths_name_a_bad_number_before_the_ops_schema(monkeypatch):
    """With inputs that require grad (or under torch.compile) a call goes through its op:
    softmax_scale, max_seqlen and a huge softcap are still refused by name, as in eager."""
    from fadsl.runtime import public

    monkeypatch.setattr(public, "check_q", lambda q, dims, shape: None)
    q = torch.zeros(1, 8, 1, 64, requires_grad=True)
    with pytest.raises(TypeError, match="softmax_scale must be a real number"):
        fadsl.attention(q, q, q, softmax_scale="x")
    packed = torch.zeros(8, 1, 64, requires_grad=True)
    with pytest.raises(TypeError, match="max_seqlen_q must be a non-negative int"):
        fadsl.attention_varlen(packed, packed, packed, None, None, max_seqlen_q=8.0)
    with pytest.raises(ValueError, match="softcap must be 0 or a whole number"):
        fadsl.attention_varlen(packed, packed, packed, None, None, softcap=10**400)
