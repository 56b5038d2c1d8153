"""The runtime's argument checks and spec loading, on the CPU (no GPU needed)."""

import pytest
import torch

import fadsl
import fadsl.runtime.arguments
from fadsl import targets
from fadsl.codegen.render import spec_hash
from conftest import ROOT

SPEC = ROOT / "examples" / "fa2_kernel1.fa"


@pytest.fixture(scope="module")
def kern():
    return fadsl.load(SPEC)


def qkv(shape=(2, 128, 4, 128), dtype=torch.bfloat16, kv_shape=None):
    kv_shape = kv_shape or shape
    return (
        torch.randn(shape, dtype=dtype),
        torch.randn(kv_shape, dtype=dtype),
        torch.randn(kv_shape, dtype=dtype),
    )


def test_load_accepts_a_path_a_string_path_and_spec_text():
    by_path = fadsl.load(SPEC)
    by_str = fadsl.load(str(SPEC))
    by_text = fadsl.load(SPEC.read_text())
    assert by_path.source("bf16") == by_str.source("bf16")
    assert spec_hash(by_text.compiled.kernel) == spec_hash(by_path.compiled.kernel)
    # The path a spec was loaded by is not part of the source, so not of the cache key.
    assert by_text.source("bf16") == by_path.source("bf16")
    assert "fa2_kernel1_bf16_kernel" in by_text.source("bf16")


def test_load_reports_spec_errors_with_location():
    with pytest.raises(fadsl.SpecError, match=r"<spec>:3:12: warps = 3 is not a power of two"):
        fadsl.load("kernel x {\n  target sm_80\n  warps    3\n}\n")


def test_load_missing_file_names_it():
    with pytest.raises(FileNotFoundError, match="nope.fa"):
        fadsl.load("nope.fa")


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda q, k, v: ([1], k, v), TypeError, r"q must be a torch.Tensor, got list"),
        (
            lambda q, k, v: (q.float(), k, v),
            TypeError,
            r"q has dtype torch.float32; kernel 'fa2_kernel1' was compiled for torch.bfloat16, torch.float16",
        ),
        (
            lambda q, k, v: (q, k.half(), v),
            TypeError,
            r"k has dtype torch.float16 but q has torch.bfloat16",
        ),
        (
            lambda q, k, v: (q[0], k, v),
            ValueError,
            r"q must be 4-D \(batch, seqlen, heads, head_dim\), got shape \(128, 4, 128\)",
        ),
        (
            lambda q, k, v: (q[..., :64], k, v),
            ValueError,
            r"q.shape\[3\] is the head_dim, which the spec fixes at 128, got 64",
        ),
        (
            lambda q, k, v: (q, k.transpose(1, 3).contiguous().transpose(1, 3), v),
            ValueError,
            r"k must be contiguous in its last dimension",
        ),
        (lambda q, k, v: (q, k, v[:, :64]), ValueError, r"k and v must have the same shape"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"k has batch 1 but q has batch 2"),
        (
            lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]),
            ValueError,
            r"q's heads \(4\) must be a multiple of k's and v's heads \(3\)",
        ),
        (
            lambda q, k, v: (q[:, :0], k, v),
            ValueError,
            r"q's sequence length must be at least 1, got 0",
        ),
        (
            lambda q, k, v: (q, k[:, :0], v[:, :0]),
            ValueError,
            r"k's sequence length must be at least 1, got 0",
        ),
        (
            lambda q, k, v: (q[:, :, :0], k[:, :, :1], v[:, :, :1]),
            ValueError,
            r"batch \(2\) and heads \(0\) must be between 1 and",
        ),
        (lambda q, k, v: (q, k, v), ValueError, r"q must be on a CUDA device, got cpu"),
    ],
)
def test_bad_tensors_are_named(kern, mutate, error, message):
    with pytest.raises(error, match=message):
        kern(*mutate(*qkv()))


def test_gqa_and_ragged_shapes_pass_the_shape_checks(kern):
    q, k, v = qkv((1, 113, 8, 128), kv_shape=(1, 203, 2, 128))
    with pytest.raises(ValueError, match="CUDA device"):  # only the device is wrong
        kern(q, k, v)


@pytest.mark.parametrize(
    "scale, error",
    [("0.1", TypeError), (True, TypeError), (float("nan"), ValueError), (-1.0, ValueError)],
)
def test_bad_softmax_scale(kern, scale, error):
    """The scale is checked before the tensors (whose device is wrong here)."""
    with pytest.raises(error, match="softmax_scale"):
        kern(*qkv(), softmax_scale=scale)


def test_seqlen_limit_is_2_to_the_30(kern):
    """The kernel adds two sequence lengths in int32: each must stay below 2^30."""
    q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    long = q.expand(1, 2**30, 1, 128)
    with pytest.raises(ValueError, match=r"q's sequence length 1073741824 must be below 2\^30"):
        kern(long, q, q)
    with pytest.raises(ValueError, match="CUDA device"):  # 2^30 - 1 passes the shape checks
        kern(q.expand(1, 2**30 - 1, 1, 128), q, q)


def test_out_with_overlapping_elements_or_shared_memory_is_refused(kern):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="out's elements must not overlap"):
        kern._check_out(q[:, :1].expand(q.shape), q, k, v)
    packed = torch.empty(2, 128, 2, 4, 128, dtype=torch.bfloat16)
    overlapping = packed.as_strided(q.shape, (128 * 2 * 4 * 128, 256, 128, 1))  # rows overlap
    with pytest.raises(ValueError, match="out's elements must not overlap"):
        kern._check_out(overlapping, q, k, v)
    with pytest.raises(ValueError, match="out shares memory with k"):
        kern._check_out(k, q, k, v)
    with pytest.raises(ValueError, match="out shares memory with q"):
        kern._check_out(q[:, :, :].view_as(q), q, k, v)
    kern._check_out(torch.empty_like(q), q, k, v)  # memory of its own
    a, b = packed.unbind(2)  # two tensors interleaved in one buffer: neither overlaps itself
    assert not fadsl.runtime.arguments.overlaps_itself(a)


def test_a_backwards_operands_are_checked_and_made_as_the_kernels_read_them():
    """backward_operands: dout must be the output's like, lse and dlse the forward LSE's
    shape on its device, lse float32; dout and the LSEs come back contiguous, dlse float32."""
    backward_operands = fadsl.runtime.arguments.backward_operands
    out = torch.zeros(2, 5, 4, 8)
    lse, shape = torch.zeros(2, 4, 5), (2, 4, 5)
    dout = torch.ones(1, 1, 1, 1).expand(2, 5, 4, 8)  # d(out.sum()): a broadcast
    got, got_lse, got_dlse = backward_operands(out, lse, dout, lse.double(), shape, out.device)
    assert got.is_contiguous() and torch.equal(got, dout) and got_lse.is_contiguous()
    assert got_dlse.dtype == torch.float32
    assert backward_operands(out, lse, out, None, shape, out.device)[2] is None
    bad = [
        ((out, lse, out[:, :4], None), "the output's gradient has shape \\(2, 4, 4, 8\\)"),
        ((out, lse, out.double(), None), "the output's gradient has shape .*float64"),
        ((out, lse[:, :3], out, None), "lse has shape \\(2, 3, 5\\)"),
        ((out, lse, out, lse[0]), "dlse has shape \\(4, 5\\)"),
        ((out, lse.double(), out, None), "lse must be float32"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            backward_operands(*args, shape, out.device)


def test_out_must_match_q(kern):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"out must match q: shape \(2, 128, 4, 128\)"):
        kern._check_out(q[:1].clone(), q, k, v)
    with pytest.raises(TypeError, match="out must be a torch.Tensor, got list"):
        kern._check_out([], q, k, v)


HOPPER_SPEC = ROOT / "examples" / "fa3_hopper.fa"


@pytest.mark.skipif(not HOPPER_SPEC.exists(), reason="the sm_90a examples are not here")
@pytest.mark.parametrize(
    "name, make",
    [
        ("q", lambda q, k, v: (torch.zeros(2, 128, 4, 132, dtype=q.dtype)[..., :128], k, v)),
        (  # rows 516 elements apart: 1032 bytes
            "v",
            lambda q, k, v: (
                q,
                k,
                v.new_zeros(2 * 128 * 516).as_strided(v.shape, (66048, 516, 128, 1)),
            ),
        ),
    ],
)
def test_sm90_names_tmas_stride_rule(name, make):
    """An sm_90a kernel refuses strides that are not multiples of 16 bytes, naming the
    argument, TMA's rule and the strides it got (in elements and in bytes)."""
    kern = fadsl.load(HOPPER_SPEC, verbose=False)
    with pytest.raises(ValueError) as error:
        kern(*make(*qkv()))
    message = str(error.value)
    assert message.startswith(f"{name} must be 16-byte aligned with strides that are multiples")
    assert "TMA descriptors need every stride but the last a multiple of 16 bytes" in message
    assert "bytes) for shape (2, 128, 4, 128)" in message


def test_a_cubin_too_small_for_its_setmaxnreg_split_is_refused_before_it_hangs():
    """The runtime hands the loaded cubin's registers per thread to the target's check."""
    hopper = fadsl.load(ROOT / "examples" / "fa3_hopper.fa", verbose=False)
    check = targets.launch_for("sm_90a").check_loaded
    # 384 threads x 168 = 128 x 24 + 256 x 240 exactly: the example's split fits.
    check(hopper.compiled.kernel, 168, 384)
    with pytest.raises(fadsl.BuildError, match=r"384 threads with 160 registers.*never return"):
        check(hopper.compiled.kernel, 160, 384)
    # sm_80 kernels have no setmaxnreg: nothing to check
    assert targets.launch_for("sm_80").check_loaded is None


@pytest.mark.parametrize("cluster, dependent", [(2, False), (1, True), (2, True)])
def test_launch_configs_carry_the_cluster_and_the_programmatic_dependency(cluster, dependent):
    """Module._launch_config (no GPU: the driver's structs only): a cluster launch carries its
    dimension, a programmatic dependent (the split decode's combine) the stream
    serialization attribute, and both together carry both."""
    from cuda.bindings import driver  # (its structs need no libcuda)

    from fadsl.runtime.driver import Module

    module = Module.__new__(Module)  # (no cubin loaded: only the config is built)
    module._driver, module.smem_bytes = driver, 4096
    config = module._launch_config((8, 4, 1), (128, 1, 1), cluster, 0, dependent)
    ids = driver.CUlaunchAttributeID
    found = {int(a.id): a for a in config.attrs}
    assert config.numAttrs == len(found) == (cluster > 1) + dependent
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (
        8,
        4,
        128,
        4096,
    )
    if cluster > 1:
        dims = found[int(ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)].value.clusterDim
        assert (dims.x, dims.y, dims.z) == (cluster, 1, 1)
    if dependent:
        serialization = found[int(ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)]
        assert serialization.value.programmaticStreamSerializationAllowed == 1
