"""GPU tests: the examples' kernels against a float32 reference (run on the device machine).

Tolerance as FlashAttention's own tests: the kernel's max error against the
float32 reference is at most twice that of PyTorch's attention computed in the
same 16-bit dtype, plus 1e-3. Outputs are poisoned with NaN before every run, so
an element the kernel fails to write cannot pass.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fadsl
from conftest import EXAMPLES, ROOT
from gpu_specs import is_8bit
from fadsl.runtime.attention import runs_on
from test_gpu_general import reference as general_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [
    (1, 64, 64, 1, 1),
    (2, 128, 128, 3, 3),
    (4, 256, 256, 16, 16),
    (3, 512, 512, 5, 5),
    (1, 1024, 1024, 8, 8),
    (2, 2048, 2048, 4, 4),
    (1, 4096, 4096, 2, 2),
    (2, 128, 512, 4, 4),  # seqlen_q != seqlen_k
    (2, 512, 64, 4, 4),
    (2, 256, 384, 8, 2),  # GQA 4:1
    (1, 192, 256, 8, 1),  # MQA
]


EXAMPLES_16BIT = [p for p in EXAMPLES if not is_8bit(p.read_text())]  # (FP8: test_gpu_fp8.py)


@pytest.fixture(scope="module", params=EXAMPLES_16BIT, ids=[p.stem for p in EXAMPLES_16BIT])
def kern(request):
    kern = fadsl.load(request.param.relative_to(ROOT))
    if not runs_on(kern.config.target, 0):
        pytest.skip(f"{kern.config.target} does not run on {torch.cuda.get_device_name(0)}")
    return kern


def reference(q, k, v, scale, dtype, causal=False):
    """softmax(q k^T * scale [+ bottom-right causal mask]) v, heads expanded for GQA, in
    ``dtype`` (softmax in fp32); float32 output."""
    return general_reference(q, k, v, scale, causal, dtype)[0]


def check(kern, dtype, batch, sq, sk, hq, hkv, scale=None):
    gen = torch.Generator(device="cuda").manual_seed(hash((batch, sq, sk, hq, hkv)) % 2**31)
    q = torch.randn(batch, sq, hq, kern.config.head_dim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, sk, hkv, kern.config.head_dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, sk, hkv, kern.config.head_dim, device="cuda", dtype=dtype, generator=gen)
    scale = scale if scale is not None else kern.config.head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    kern(q, k, v, scale, out=out)
    torch.cuda.synchronize()
    causal = kern.config.mask.value == "causal"
    ref = reference(q, k, v, scale, torch.float32, causal)
    low = reference(q, k, v, scale, dtype, causal)
    assert not out.isnan().any(), "some outputs were never written"
    err = (out.float() - ref).abs().max().item()
    bound = 2 * (low - ref).abs().max().item() + 1e-3
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_float32_reference(kern, dtype, shape):
    check(kern, dtype, *shape)


def test_softmax_scale_and_out_argument(kern):
    check(kern, torch.bfloat16, 2, 128, 256, 4, 4, scale=0.3)


def test_non_contiguous_inputs_through_strides(kern):
    """q sliced out of a packed qkv tensor: strides, not copies."""
    d = kern.config.head_dim
    qkv = torch.randn(2, 256, 3, 4, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    out = kern(q, k, v)
    causal = kern.config.mask.value == "causal"
    ref = reference(q, k, v, d**-0.5, torch.float32, causal)
    low = reference(q, k, v, d**-0.5, torch.bfloat16, causal)
    assert (out.float() - ref).abs().max() <= 2 * (low - ref).abs().max() + 1e-3


def test_second_process_reuses_the_cache(tmp_path):
    """A fresh process loads the built kernel from the disk cache in under 2 s."""
    spec = ROOT / "examples" / "fa2_kernel1.fa"
    code = (
        "import time, torch, fadsl; t = time.perf_counter(); "
        f"k = fadsl.load({str(spec)!r}); q = torch.randn(1, 64, 1, 128, device='cuda', "
        "dtype=torch.bfloat16); k(q, q, q); torch.cuda.synchronize(); "
        "print(time.perf_counter() - t)"
    )
    env = dict(os.environ)
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    run()  # may build, if no earlier test did
    elapsed = float(run().stdout.strip().splitlines()[-1])
    assert elapsed < 2.0, f"cached load took {elapsed:.2f} s"
