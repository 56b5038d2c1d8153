"""GPU tests of the runtime: torch.compile fullgraph, CUDA graph replay, a side stream, a second
GPU, the autograd error, resources() per device, and cold/warm start times (run on the device)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import fadsl
from conftest import ROOT
from test_gpu_general import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SPEC = ROOT / "examples" / "fa2_causal.fa"


@pytest.fixture(scope="module")
def kern():
    return fadsl.load(SPEC)


def qkv(device="cuda", seed=0, shape=(2, 300, 8, 128), heads_kv=2):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    kv_shape = (shape[0], shape[1] + 17, heads_kv, shape[3])
    k = torch.randn(kv_shape, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(kv_shape, device=device, dtype=torch.bfloat16, generator=gen)
    return q, k, v


def assert_close(out, q, k, v, scale=128**-0.5):
    ref, _ = reference(q, k, v, scale, True, torch.float32)
    low, _ = reference(q, k, v, scale, True, torch.bfloat16)
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * (low - ref).abs().max().item() + 1e-3, err


def test_compile_fullgraph_matches_eager(kern):
    q, k, v = qkv()

    def f(q, k, v):
        o, lse = kern(q, k, v, return_lse=True)
        return o * 2, lse.exp()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    (o, e), (ref_o, ref_e) = compiled(q, k, v), f(q, k, v)
    assert torch.equal(o, ref_o) and torch.equal(e, ref_e)
    assert_close(o / 2, q, k, v)


def test_cuda_graph_replay_matches(kern):
    q, k, v = qkv(seed=1)
    out = torch.empty_like(q)
    kern(q, k, v, out=out)  # warm-up: build and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(q, k, v, out=out)
        captured = kern(q, k, v)  # an output allocated in the graph's pool
    for seed in (2, 3):
        new = qkv(seed=seed)
        for dst, src in zip((q, k, v), new):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, q, k, v)
        assert torch.equal(captured, out)


def test_side_stream(kern):
    q, k, v = qkv(seed=4)
    expected = kern(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = torch.full_like(q, float("nan"))
        kern(q, k, v, out=out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_second_gpu(kern):
    q, k, v = qkv(device="cuda:1", seed=5)
    with torch.cuda.device(0):  # the current device is not the tensors'
        out = kern(q, k, v)
    assert out.device == torch.device("cuda:1")
    torch.cuda.synchronize(1)
    assert_close(out, q, k, v)
    assert kern.resources("bf16", "cuda:1")["registers"] > 0


def test_autograd_says_forward_only(kern):
    q, k, v = (t.requires_grad_() for t in qkv(seed=6))
    out = kern(q, k, v)
    assert out.grad_fn is not None
    with pytest.raises(RuntimeError, match="forward-only"):
        out.float().sum().backward()


def test_resources_of_the_built_kernel(kern):
    found = kern.resources("bf16", torch.device("cuda", 0))
    assert 0 < found["registers"] <= 255 and found["ctas_per_sm"] >= 1
    assert found["local_bytes"] == found["spill_store_bytes"] == found["stack_bytes"] == 0
    assert found["smem_bytes"] == kern.compiled.kernel.smem_bytes and found["threads"] == 128


def test_out_aliasing_q_is_refused(kern):
    q, k, v = qkv(seed=7)
    with pytest.raises(ValueError, match="out shares memory with q"):
        kern(q, k, v, out=q)


STARTUP = """
import sys, time, torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()  # torch imported, CUDA initialised
start = time.perf_counter()
import fadsl
imported = time.perf_counter()
kern = fadsl.load(sys.argv[1])
q = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
kern(q, q, q)
torch.cuda.synchronize()
print(f"{imported - start:.3f} {time.perf_counter() - imported:.3f}")
"""


def test_cold_and_warm_start(tmp_path):
    """A new spec, cold cache: fadsl.load + first call <= 5 s; again in a new process (cubin
    cached) <= 0.3 s. Timed in a process where torch is imported and CUDA initialised;
    `import fadsl` is timed apart."""
    name = f"startup_{os.getpid()}"
    spec = (ROOT / "examples" / "fa2_pipelined.fa").read_text()
    path = tmp_path / f"{name}.fa"
    path.write_text(spec.replace("kernel fa2_pipelined", f"kernel {name}"))
    env = {**os.environ, "FADSL_CACHE_DIR": str(tmp_path / "cache")}
    times = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", STARTUP, str(path)], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        times.append([float(x) for x in proc.stdout.split()[-2:]])
        print(proc.stderr.strip())
    (cold_import, cold), (warm_import, warm) = times
    print(
        f"load + first call: cold {cold:.3f} s, warm {warm:.3f} s; "
        f"import fadsl: {cold_import:.3f} s, {warm_import:.3f} s"
    )
    assert cold <= 5.0 and warm <= 0.3, times


def test_bench_times_variants_side_by_side_in_rounds(monkeypatch):
    """`fadsl bench --against --rounds`: the variant checked and timed on the same tensors,
    named after its kernel, each contender timed once per round; the table compares each
    fadsl contender with each backend and the variant with the kernel."""
    from fadsl.tools import bench

    text = (ROOT / "examples" / "fa2_hdim64.fa").read_text()
    kern = fadsl.load(text, verbose=False)
    variant = fadsl.load(text.replace("kernel fa2_hdim64", "kernel fa2_hdim64_twin"), verbose=False)
    timed = []
    real_time = bench._time
    monkeypatch.setattr(bench, "_time", lambda fn, *a: timed.append(fn) or real_time(fn, *a))
    result = bench.run(
        kern, seqlens=(256,), tokens=512, heads=2, warmup=1, runs=3,
        against=(variant,), rounds=2, log=lambda s: None,
    )  # fmt: skip
    row = result["rows"][0]
    names = [n for n in row["tflops"] if n.startswith("fadsl")]
    assert names == ["fadsl", f"fadsl:{variant.config.name}"]
    assert all(row["tflops"][n] > 0 for n in names)
    n = len(row["tflops"])
    assert len(timed) == 2 * n  # every contender, once per round
    contender = dict(zip(bench.balanced_orders(n)[0], timed[:n]))  # the design's rows
    assert timed[n:] == [contender[i] for i in bench.balanced_orders(n)[1]]
    assert result["method"]["rounds"] == 2 and result["against"][0]["kernel"] == names[1]
    assert row["rounds"] == 2 and row["balanced"] is False  # 2 rows of a 4- or 6-row design
    assert f"{names[1]}/fadsl" in bench.table(result).splitlines()[0]
