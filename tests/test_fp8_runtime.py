"""fadsl.attention and loaded 8-bit specs on 8-bit inputs (issue 42, research/fp8-forward.md
§3.7), on the stand-in device (tests/fake_cuda.py): every bad argument named, the shipped
8-bit examples chosen (and refused head_dims named with why), the descales packed into the
kernel's second parameter, plans keyed on the descales' presence, shapes and strides with
their addresses read per call, and torch.compile tracing the loaded kernel's op."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
import fake_cuda
from conftest import ROOT
from fadsl.runtime import dispatch, fp8_planned
from fadsl.runtime.fp8_calls import check_descales
from fadsl.targets import get
from fadsl.targets.sm90.host import fp8 as fp8_host

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def device(monkeypatch):
    found = fake_cuda.install(monkeypatch)
    yield found
    fake_cuda.uninstall()


def inputs(dtype=E4M3, b=2, sq=300, sk=500, hq=8, hkv=2, d=128):
    q = torch.randn(b, sq, hq, d).to(dtype)
    k = torch.randn(b, sk, hkv, d).to(dtype)
    v = torch.randn(b, sk, hkv, d).to(dtype)
    return q, k, v


def _descales(log_entry):
    return dict(zip(fp8_host.DESCALES_FIELDS, fp8_host.DESCALES.unpack(log_entry.second)))


# ---------------------------------------------------------------- dispatch and launches
@pytest.mark.parametrize("seqlen_q", [1025, 1024, 300])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("causal", [False, True])
def test_fadsl_attention_runs_the_shipped_8bit_example(device, dtype, causal, seqlen_q):
    """The head_dim 128 examples, their 128 x 128 twins for up to 1024 queries
    (Target.shipped_fp8_short)."""
    log, _ = device
    q, k, v = inputs(dtype, sq=seqlen_q)
    qd = torch.rand(2, 2)
    out, lse = fadsl.attention(q, k, v, causal, q_descale=qd, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 8, seqlen_q)
    (launch,) = log
    name = "fa3_fp8_hdim128_causal" if causal else "fa3_fp8_hdim128"
    assert launch.kernel == name + ("_short" if seqlen_q <= 1024 else "")
    fields = _descales(launch)
    assert fields["q"] == qd.data_ptr() and fields["k"] == 0 and fields["v"] == 0
    assert (fields["q_batch_stride"], fields["q_head_stride"]) == (2, 1)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_256_runs_its_shipped_example(device, dtype, causal):
    """examples/fa3_fp8_hdim256.fa and, causal, fa3_fp8_hdim256_causal.fa (128 x 128 tiles,
    the causal one with overlap off; both 0 spills) are what fadsl.attention runs at head_dim
    256, on the loaded spec's grid."""
    log, _ = device
    q, k, v = inputs(dtype, d=256)
    qd = torch.rand(2, 2)
    out = fadsl.attention(q, k, v, causal, q_descale=qd)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    name = "fa3_fp8_hdim256_causal" if causal else "fa3_fp8_hdim256"
    assert log[-1].kernel == name
    kern = fadsl.load(ROOT / "examples" / f"{name}.fa", verbose=False)
    assert kern.config.block_c == 128 and kern.config.ext.overlap == (not causal)
    kern(q, k, v, 256**-0.5, q_descale=qd)
    assert log[-1].kernel == name
    assert log[-1].grid == log[-2].grid


def test_out_dtype_fp16_runs_the_output_fp16_variant(device):
    log, _ = device
    q, k, v = inputs(sq=1100)
    out = fadsl.attention(q, k, v, out_dtype=torch.float16)
    assert out.dtype == torch.float16
    assert log[-1].kernel == "fa3_fp8_hdim128_out_fp16"
    fadsl.attention(q[:, :1000], k, v, out_dtype=torch.float16)
    assert log[-1].kernel == "fa3_fp8_hdim128_short_out_fp16"
    kern = dispatch.fp8_attention_kernel(q, False, torch.float16)
    assert kern.config.out_dtype.value == "fp16" and kern.config.dtypes == (
        dispatch._shipped("fa3_fp8_hdim128").config.dtypes
    )


def test_the_shipped_8bit_table_names_examples_with_both_dtypes():
    target = get("sm_90a")
    assert set(target.shipped_fp8) == {(d, c) for d in (64, 128, 256) for c in (False, True)}
    for (head_dim, causal), name in target.shipped_fp8.items():
        kern = fadsl.load(ROOT / "examples" / f"{name}.fa", verbose=False)
        cfg = kern.config
        assert cfg.head_dim == head_dim and (cfg.mask.value == "causal") == causal
        assert [d.value for d in cfg.dtypes] == ["e4m3", "e5m2"]
        assert cfg.out_dtype.value == "bf16"
    assert not get("sm_80").shipped_fp8


def test_the_short_8bit_specs_are_their_long_twins_on_128_x_128_tiles():
    """Target.shipped_fp8_short: each (head_dim, mask) has a long spec, and its short one is
    that spec (dtypes, output, mask, head_dim, stages) on 128 x 128 tiles with two consumer
    warpgroups (the long one: more keys a block, or at head_dim 64 causal three consumers of
    192 rows)."""
    target = get("sm_90a")
    assert set(target.shipped_fp8_short) == {(64, True), (128, False), (128, True)}
    for key, (limit, name) in target.shipped_fp8_short.items():
        assert limit in (1024, 2048) and name == target.shipped_fp8[key] + "_short"
        short = fadsl.load(ROOT / "examples" / f"{name}.fa", verbose=False).config
        long = fadsl.load(ROOT / "examples" / f"{target.shipped_fp8[key]}.fa", verbose=False)
        long = long.config
        assert (short.block_r, short.block_c) == (128, 128)
        assert long.block_c > 128 or long.block_r > 128
        for field in ("dtypes", "out_dtype", "mask", "head_dim"):
            assert getattr(short, field) == getattr(long, field), (name, field)
        assert short.ext.stages == long.ext.stages


@pytest.mark.parametrize("seqlen_q, short", [(2048, True), (2049, False)])
def test_head_dim_64_causal_takes_its_short_spec_up_to_2048(device, seqlen_q, short):
    log, _ = device
    q, k, v = inputs(b=1, sq=seqlen_q, sk=seqlen_q, hq=2, hkv=2, d=64)
    fadsl.attention(q, k, v, True)
    assert log[-1].kernel == "fa3_fp8_hdim64_causal" + ("_short" if short else "")
    fadsl.attention(q, k, v, False)  # (no short spec without the mask)
    assert log[-1].kernel == "fa3_fp8_hdim64"


@pytest.mark.parametrize(
    "head_dim, causal, why",
    [
        (96, False, "8-bit head_dim 64, 128, 256 with causal=False)"),
        (32, True, "8-bit head_dim 64, 128, 256 with causal=True)"),
    ],
)
def test_an_unshipped_head_dim_is_named_with_why(device, head_dim, causal, why):
    q, k, v = inputs(d=head_dim)
    with pytest.raises(ValueError, match=f"head_dim\\) = {head_dim}") as err:
        fadsl.attention(q, k, v, causal)
    assert why in str(err.value) and "torch.float8_e4m3fn" in str(err.value)


def test_an_older_gpu_is_told_8bit_needs_sm90(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(dispatch, "_CAPABILITY", {})
    monkeypatch.setattr(dispatch, "_CHOSEN", {})  # (the earlier tests' choices: on 9.0)
    q, k, v = inputs()
    with pytest.raises(ValueError, match="compute capability 8.0.*8-bit head_dim none") as err:
        fadsl.attention(q, k, v)
    # what needs what is asked of the targets (Target.shipped_fp8, capabilities.devices)
    assert "8-bit q, k and v need sm_90a, compute capability 9.0)" in str(err.value)


# ---------------------------------------------------------------- argument errors
def _bad_calls():
    q, k, v = inputs()
    good = torch.ones(2, 2)
    return {
        "descale not a tensor": ({"q_descale": 0.5}, TypeError, "q_descale must be a torch.Tensor"),
        "descale dtype": (
            {"k_descale": good.double()},
            TypeError,
            "k_descale must be float32, got torch.float64",
        ),
        "descale per query head": (
            {"v_descale": torch.ones(2, 8)},
            ValueError,
            r"v_descale must have shape \(batch, heads_kv\) = \(2, 2\)",
        ),
        "descale 0-d": ({"q_descale": torch.tensor(0.5)}, ValueError, "q_descale must have shape"),
        "out_dtype": ({"out_dtype": torch.float32}, TypeError, "out_dtype must be torch.bfloat16"),
        "out_dtype not a dtype": (
            {"out_dtype": ["bf16"]},
            TypeError,
            "out_dtype must be torch.bfloat16",
        ),
        "window": ({"window_size": (128, 0)}, ValueError, "window_size=.*8-bit q, k and v"),
        "softcap": ({"softcap": 30}, ValueError, "softcap=30 with 8-bit"),
        "causal type": ({"causal": 1}, TypeError, "causal must be True or False"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_a_bad_argument_is_named(device, case):
    keywords, error, message = _bad_calls()[case]
    q, k, v = inputs()
    with pytest.raises(error, match=message):
        fadsl.attention(q, k, v, **keywords)


def test_mixed_or_16bit_operands_are_named(device):
    q, k, v = inputs()
    with pytest.raises(TypeError, match="k has dtype torch.float8_e5m2 but q has"):
        fadsl.attention(q, k.to(torch.float32).to(E5M2), v)
    with pytest.raises(
        TypeError, match="v has dtype torch.bfloat16; kernel 'fa3_fp8_hdim128_short'"
    ):
        fadsl.attention(q, k, v.to(torch.float32).to(torch.bfloat16))
    bf = torch.randn(2, 30, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q_descale is for 8-bit q, k and v.*q is torch.bfloat16"):
        fadsl.attention(bf, bf, bf, q_descale=torch.ones(2, 8))
    with pytest.raises(TypeError, match="out_dtype is for 8-bit"):
        fadsl.attention(bf, bf, bf, out_dtype=torch.float16)


def test_strides_must_be_multiples_of_16_bytes(device):
    """A row of 136 bytes is not 16-byte aligned in 8 bits (8 elements of 16-bit data are)."""
    q, k, v = inputs()
    wide = torch.randn(2, 500, 2, 136).to(E4M3)[..., :128]
    with pytest.raises(ValueError, match="k must be 16-byte aligned with strides that are "
                       "multiples of 16 elements"):  # fmt: skip
        fadsl.attention(q, wide, v)
    padded = torch.randn(2, 500, 2, 144).to(E4M3)[..., :128]  # 144 bytes: a multiple of 16
    fadsl.attention(q, padded, v)


def test_gradients_are_refused_naming_the_argument(device):
    q, k, v = inputs()
    qd = torch.ones(2, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="q_descale requires grad.*no backward"):
        fadsl.attention(q, k, v, q_descale=qd)
    with torch.no_grad():
        fadsl.attention(q, k, v, q_descale=qd)  # no gradients wanted: runs
    leaf = torch.randn(2, 300, 8, 128).to(E4M3).requires_grad_()
    with pytest.raises(RuntimeError, match="fadsl.attention: q requires grad"):
        fadsl.attention(leaf, k, v)


def test_check_descales_reads_no_values_and_bounds_the_int_index():
    q = torch.empty(2, 10, 4, 128, device="meta", dtype=E4M3)
    k = torch.empty(2, 10, 2, 128, device="meta", dtype=E4M3)
    nan = torch.full((2, 2), math.nan, device="meta")
    assert check_descales((nan, None, nan), q, k) == (nan, None, nan)  # values never read
    huge = torch.empty_strided((2, 2), (2**31, 1), device="meta")
    with pytest.raises(ValueError, match="q_descale's strides .* 2\\^31 - 1"):
        check_descales((huge, None, None), q, k)
    cpu = torch.ones(2, 2)
    with pytest.raises(ValueError, match="k_descale is on cpu but q is on meta"):
        check_descales((None, cpu, None), q, k)


def test_a_loaded_8bit_spec_takes_the_descales_and_out(device):
    log, _ = device
    kern = fadsl.load(ROOT / "examples" / "fa3_fp8_hdim128_causal.fa", verbose=False)
    q, k, v = inputs(E5M2)
    vd = torch.tensor([2.0]).expand(2, 2)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    assert kern(q, k, v, 0.2, out=out, v_descale=vd) is out
    assert _descales(log[-1])["v"] == vd.data_ptr()
    with pytest.raises(TypeError, match="unexpected keyword argument 'slopes'.*takes q_descale"):
        kern(q, k, v, slopes=vd)
    with pytest.raises(ValueError, match="out must match q: .*torch.bfloat16"):
        kern(q, k, v, out=torch.empty(q.shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="k_descale must have shape"):
        kern(q, k, v, k_descale=torch.ones(3, 2))


# ---------------------------------------------------------------- plans
def test_a_plan_launches_what_the_checked_path_launches(device):
    """Three calls of one signature (the third through its plan), each with new descale
    tensors and the same allocations: identical params, the descales' own addresses."""
    log, allocator = device
    q, k, v = inputs()
    seen = []
    for call in range(3):
        allocator.next_call(0)
        qd, vd = torch.rand(2, 2), torch.rand(2, 2)
        fadsl.attention(q, k, v, True, q_descale=qd, v_descale=vd, return_lse=True)
        fields = _descales(log[-1])
        assert (fields["q"], fields["k"], fields["v"]) == (qd.data_ptr(), 0, vd.data_ptr())
        seen.append((qd, vd))  # (kept alive: no address reused between calls)
    assert len(fp8_planned._FP8) == 1
    assert log[0].params == log[1].params == log[2].params
    assert log[0].second != log[2].second


@pytest.mark.parametrize(
    "change",
    ["k_descale added", "q_descale strided", "q_descale scalar", "out_dtype", "return_lse"],
)
def test_a_changed_descale_signature_is_checked_and_packed_again(device, change):
    log, allocator = device
    q, k, v = inputs()
    qd = torch.rand(2, 2)
    for _ in range(3):  # planned
        fadsl.attention(q, k, v, q_descale=qd)
    keywords = {"q_descale": qd}
    if change == "k_descale added":
        keywords["k_descale"] = torch.rand(2, 2)
    elif change == "q_descale strided":
        keywords["q_descale"] = torch.rand(2, 2).t()
    elif change == "q_descale scalar":
        keywords["q_descale"] = torch.tensor([1.0]).expand(2, 2)
    elif change == "out_dtype":
        keywords["out_dtype"] = torch.float16
    else:
        keywords["return_lse"] = True
    fadsl.attention(q, k, v, **keywords)
    fields = _descales(log[-1])
    given = keywords["q_descale"]
    assert fields["q"] == given.data_ptr()
    strides = tuple(st if n > 1 else 0 for n, st in zip(given.shape, given.stride()))
    assert (fields["q_batch_stride"], fields["q_head_stride"]) == strides
    assert fields["k"] == (keywords["k_descale"].data_ptr() if "k_descale" in keywords else 0)
    bad = dict(keywords, q_descale=torch.ones(2, 3))
    with pytest.raises(ValueError, match="q_descale must have shape"):
        fadsl.attention(q, k, v, **bad)


# ---------------------------------------------------------------- torch.compile
@pytest.fixture
def cpu_kernel(monkeypatch):
    """The 8-bit example on CPU tensors: the device check skipped, the launch a reference
    that writes out (the dequantized attention), so that the op's plumbing runs here."""
    from fadsl.runtime.attention import FlashAttention

    original = FlashAttention.check_inputs

    def check_inputs(self, q, k, v):
        try:
            return original(self, q, k, v)
        except ValueError as err:
            if "must be on a CUDA device" not in str(err):
                raise
            return self.config.dtypes[0]

    def launch(self, dtype, q, k, v, out, lse, scale, inputs=(), descales=None):
        out.copy_(_reference(q, k, v, descales, scale).to(out.dtype))

    monkeypatch.setattr(FlashAttention, "check_inputs", check_inputs)
    monkeypatch.setattr(FlashAttention, "launch", launch)
    monkeypatch.setattr(FlashAttention, "_check_out", lambda *a: None)
    return fadsl.load(ROOT / "examples" / "fa3_fp8_hdim128.fa", verbose=False)


def _reference(q, k, v, descales, scale):
    groups = q.shape[2] // k.shape[2]
    qd, kd, vd = (torch.ones(q.shape[0], k.shape[2]) if d is None else d for d in descales)
    qf = q.float() * qd.repeat_interleave(groups, 1)[:, None, :, None]
    kf = (k.float() * kd[:, None, :, None]).repeat_interleave(groups, 2)
    vf = (v.float() * vd[:, None, :, None]).repeat_interleave(groups, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vf)


def test_torch_compile_traces_the_8bit_op(cpu_kernel):
    q, k, v = inputs(sq=64, sk=96, hq=4)
    qd, vd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    torch._dynamo.reset()

    def f(q, k, v, qd, vd):
        return cpu_kernel(q, k, v, q_descale=qd, v_descale=vd)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qd, vd)
    assert got.dtype == torch.bfloat16
    expected = _reference(q, k, v, (qd, None, vd), 128**-0.5).to(torch.bfloat16)
    assert torch.equal(got, expected)


def test_fake_tensors_get_the_descale_checks(cpu_kernel):
    """A bad descale shape is named while tracing, before anything runs."""
    q, k, v = inputs(sq=64, sk=96, hq=4)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, d: cpu_kernel(q, k, v, k_descale=d), fullgraph=True, backend="aot_eager"
    )
    with pytest.raises(Exception, match=r"k_descale must have shape \(batch, heads_kv\)"):
        compiled(q, k, v, torch.ones(2, 4))


def test_every_launch_of_an_8bit_kernel_passes_its_descales(device):
    """forward() and launch() without descales (fadsl bench, direct calls) still pass the
    second parameter (descales of 1) and allocate O in the output type, never q's."""
    log, _ = device
    kern = fadsl.load(ROOT / "examples" / "fa3_fp8_hdim128.fa", verbose=False)
    q, k, v = inputs()
    out = kern.forward(q, k, v, 0.1)
    assert out.dtype == torch.bfloat16
    assert log[-1].second == fp8_host.DESCALES.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)
    kern.launch(kern.config.dtypes[0], q, k, v, out, None, 0.1)
    assert log[-1].second == fp8_host.DESCALES.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_a_traced_call_checks_out_as_eager_does(cpu_kernel, bad):
    """Under torch.compile a loaded 8-bit kernel's out= gets the eager call's checks of shape,
    dtype and device (before 2026-11-30 a float32 out took a silent cast and an out of
    another batch a silent broadcast)."""
    q, k, v = inputs(sq=64, sk=96, hq=4)
    shape = q.shape if bad == "dtype" else (q.shape[0] + 1, *q.shape[1:])
    out = torch.empty(shape, dtype=torch.float32 if bad == "dtype" else torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, out: cpu_kernel(q, k, v, out=out), fullgraph=True, backend="aot_eager"
    )
    with pytest.raises(Exception, match="out must match q"):
        compiled(q, k, v, out)
