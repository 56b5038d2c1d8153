"""The sm_90a backward of capped and windowed forwards on the GPU: dQ, dK, dV against float32
autograd of the reference (scores capped by softcap tanh(s scale / softcap), then the window
and causal masks), FlashAttention's rule (error at most twice PyTorch's own in the input
dtype, plus 1e-4). Windows narrow and wide, two-sided and left-only with the causal mask,
rows that see no key; softcap 30 and 50 with logits far past the cap; GQA; both dtypes;
`deterministic on` with a window (bitwise-stable, its tickets start at the m-block's first
n-block); and a window's backward skips the blocks outside it."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import fadsl
from test_gpu_backward import check_rule, inputs, poison_allocator
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

SPECS = Path(__file__).resolve().parent / "specs" / "sm90"
RED = "    overlap on\n    dQ: rf -red.add-> gmem\n"
STAGED = "    overlap on\n    stages 2\n"
# name -> (forward spec, its mask line (None: the spec's), softcap (None: the spec's), the
# backward block's lines)
VARIANTS = {
    # causal, window(256) at head_dim 128: B_r 64 and B_r 80
    "causal_window": ("fa3_window", None, None, RED + "    stages 3\n"),
    "causal_window_br80": (
        "fa3_window",
        None,
        None,
        RED
        + "    stages 3\n    tile B_r = 80, B_c = 128\n    dS: rf -stmatrix-> smem[cta] -wgmma-> rf\n",
    ),
    # two-sided, narrower than a block, and a wide one
    "narrow_window": ("fa3_window", "window(16, 8)", None, RED),
    "wide_window": ("fa3_window", "window(700, 300)", None, STAGED),
    # softcap 50 at head_dim 128 (B_r 64), 30 with a two-sided window at head_dim 64 (B_r 128)
    "softcap50": ("fa3_softcap", None, None, RED + "    stages 3\n"),
    "window_softcap30": ("fa3_window_softcap", None, None, RED),
    "causal_softcap30": ("fa3_softcap", "causal", 30, STAGED),
    # `dq_lag on` (dQ one m-block behind, no meeting): the window at B_r 80, window and
    # softcap at head_dim 64's B_r 128
    "causal_window_br80_lag": (
        "fa3_window",
        None,
        None,
        RED
        + "    dq_lag on\n    stages 3\n    tile B_r = 80, B_c = 128\n"
        + "    dS: rf -stmatrix-> smem[cta] -wgmma-> rf\n",
    ),
    "window_softcap30_lag": (
        "fa3_window_softcap",
        None,
        None,
        RED + "    dq_lag on\n    tile B_r = 128, B_c = 128\n",
    ),
}
DETERMINISTIC = {
    "window_deterministic": (
        "fa3_window",
        "window(300, 40)",
        None,
        STAGED + "    deterministic on\n",
    ),
    "causal_window_deterministic": ("fa3_window", None, None, STAGED + "    deterministic on\n"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): one key; more keys than queries; more
# queries than keys (with the causal mask the first rows see no key); GQA; several m-blocks
# wholly outside each window
SHAPES = [
    (1, 1, 1, 1, 1),
    (1, 300, 1100, 4, 1),
    (1, 1000, 333, 8, 2),
    (2, 257, 700, 4, 4),
    (1, 2048, 2048, 2, 1),
]
_loaded: dict[str, object] = {}


def spec_text(name: str) -> str:
    base, mask, softcap, block = (VARIANTS | DETERMINISTIC)[name]
    text = (SPECS / f"{base}.fa").read_text()
    if mask is not None:
        text = re.sub(
            r"^(\s*mask\s+)[^#\n]*", lambda m: f"{m[1]}{mask}  ", text, count=1, flags=re.M
        )
    if softcap is not None:
        text = re.sub(
            r"^(\s*softcap\s+)\d+", lambda m: f"{m[1]}{softcap}", text, count=1, flags=re.M
        )
    body, close = text.rstrip().rsplit("}", 1)
    return f"{body}  backward {{\n{block}  }}\n}}{close}\n"


def kernel(name: str):
    if name not in _loaded:
        _loaded[name] = fadsl.load(spec_text(name), verbose=False)
    return _loaded[name]


def window_of(kern) -> tuple[int, int] | None:
    window = kern.config.window
    return None if window is None else (window.left, window.right)


def reference_grads(kern, q, k, v, dout, dtype):
    """Gradients of the reference in ``dtype`` (float32: the truth) for the kernel's mask,
    window and softcap."""
    cfg = kern.config
    scale = 1.0 / math.sqrt(cfg.head_dim)
    softcap = cfg.features.softcap or None
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    causal = cfg.mask.value == "causal"
    out, _ = reference(*leaves, scale, causal, dtype, softcap=softcap, window=window_of(kern))
    (out.to(torch.float32) * dout.to(torch.float32)).sum().backward()
    return [t.grad.to(torch.float32) for t in leaves]


def gradients(kern, q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern(*leaves).backward(dout)
    return [t.grad for t in leaves]


CASES = [(n, d, s) for n in VARIANTS for d in DTYPES for s in SHAPES]


@pytest.mark.parametrize(
    "name, dtype, shape", CASES, ids=[f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}" for c in CASES]
)
def test_gradients_match_float32_autograd(name, dtype, shape):
    kern = kernel(name)
    torch_dtype = DTYPES[dtype]
    q, k, v, dout = inputs(shape, torch_dtype, kern.config.head_dim, seed=sum(shape) * 17 + 5)
    if kern.config.features.softcap:
        q = q * 8  # logits far past the cap: tanh saturates, its derivative near 0
    poison_allocator(4 * q.numel() * 8)
    ours = gradients(kern, q, k, v, dout)
    truth = reference_grads(kern, q, k, v, dout, torch.float32)
    own = reference_grads(kern, q, k, v, dout, torch_dtype)
    for grad, t, o, what in zip(ours, truth, own, ("dq", "dk", "dv")):
        assert grad.dtype == torch_dtype and grad.shape == t.shape
        check_rule(grad, t, o, f"{name} {what}")


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_deterministic_window_gradients_are_bitwise_stable(name):
    """With a window an m-block's first n-block is not 0: its tickets start there, so no
    reduce-add waits for an n-block that never visits (a hang) and the order is fixed."""
    kern = kernel(name)
    q, k, v, dout = inputs((2, 900, 1200, 8, 2), torch.bfloat16, kern.config.head_dim, seed=13)
    runs = [gradients(kern, q, k, v, dout) for _ in range(5)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    truth = reference_grads(kern, q, k, v, dout, torch.float32)
    own = reference_grads(kern, q, k, v, dout, torch.bfloat16)
    for grad, t, o, what in zip(runs[0], truth, own, ("dq", "dk", "dv")):
        check_rule(grad, t, o, f"{name} {what}")


def _median_ms(step, runs=10) -> float:
    """The GPU's time for step: a spin kernel of about 2 ms queued first keeps the GPU busy
    while the host enqueues step, so the host's time (autograd, the launches) is not timed;
    a small backward is host-bound otherwise (window(256) at 8k measured 2.5x, not 8x)."""
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def test_a_window_skips_the_blocks_outside_it():
    """causal, window(256) at 8k: each n-block visits the 3-5 m-blocks its keys' window
    reaches, not all those below the diagonal, so its backward is far faster than the causal
    one's (issue 40 asks at least 3x for a window of 1024; at 256 the work is 16x less)."""
    windowed = kernel("causal_window")
    causal = fadsl.load(
        spec_text("causal_window").replace("causal, window(256)", "causal"), verbose=False
    )
    q, k, v, dout = inputs((1, 8192, 8192, 16, 16), torch.bfloat16, 128, seed=2)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    outs = {name: kern(*leaves) for name, kern in (("window", windowed), ("causal", causal))}

    def backward(name):
        return lambda: torch.autograd.grad(outs[name], leaves, dout, retain_graph=True)

    for name in outs:
        backward(name)()
    ratio = _median_ms(backward("causal")) / _median_ms(backward("window"))
    assert ratio > 3, f"window(256) backward only {ratio:.2f}x faster than causal at 8k"
