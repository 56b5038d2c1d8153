"""Device harness for the sm_90a prototype kernel (emit/sm90/prototype/fa3_fwd.cu).

Builds one cubin per configuration with nvcc (in parallel), loads them through
cuda.bindings.driver, encodes the four TMA descriptors with cuTensorMapEncodeTiled from
torch tensors (4-D: head_dim, seqlen, heads, batch, with the tensors' strides) and
launches on torch's current stream.

Usage (on the device, repository root):
  python3 scripts/sm90_proto.py build                 # compile every config, print resources
  python3 scripts/sm90_proto.py test [--quick]        # correctness vs a float32 reference
  python3 scripts/sm90_proto.py bench [--seqlens ...] # TFLOP/s vs SDPA FLASH and cuDNN
  python3 scripts/sm90_proto.py sanitize              # small shapes once (compute-sanitizer)
  python3 scripts/sm90_proto.py profile --only NAME   # 3 launches at seqlen 8192 (for ncu)
  python3 scripts/sm90_proto.py all                   # build, test, bench
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fadsl.params import fast_div  # noqa: E402  (FwdParamsSm90's FastDiv fields)

SOURCE = ROOT / "emit" / "sm90" / "prototype" / "fa3_fwd.cu"
# The sm90 headers include params.cuh as a neighbour (as `fadsl compile` writes them).
INCLUDES = [
    ROOT / "emit" / "common" / "include",
    ROOT / "emit" / "common" / "include" / "fadsl",
    ROOT / "emit" / "sm90" / "include",
]
BUILD = ROOT / "build" / "sm90"


@dataclass(frozen=True)
class Config:
    dtype: str  # "bf16" | "fp16"
    head_dim: int
    wgs: int  # consumer warpgroups; B_r = 64 * wgs
    block_n: int
    stages: int
    causal: bool

    @property
    def name(self) -> str:
        c = "causal" if self.causal else "full"
        return f"{self.dtype}_d{self.head_dim}_{64 * self.wgs}x{self.block_n}_s{self.stages}_{c}"

    def defines(self) -> list[str]:
        return [
            f"-DFA3_DTYPE={self.dtype}",
            f"-DFA3_HEAD_DIM={self.head_dim}",
            f"-DFA3_WGS={self.wgs}",
            f"-DFA3_BLOCK_N={self.block_n}",
            f"-DFA3_STAGES={self.stages}",
            f"-DFA3_CAUSAL={int(self.causal)}",
        ]


# Tile choices: FlashAttention-3's (d64 192 x 128 with 3 consumer warpgroups, d128 128 x 128,
# d256 128 x 80; two stages), except d128 non-causal, where FA3 takes B_c = 176 but 128 measured
# as fast or faster here (NOTES.md, run 1).
def default_config(dtype: str, head_dim: int, causal: bool) -> Config:
    wgs, block_n = {64: (3, 128), 128: (2, 128), 256: (2, 80)}[head_dim]
    return Config(dtype, head_dim, wgs, block_n, 2, causal)


def all_configs() -> list[Config]:
    cfgs = [
        default_config(dt, d, c)
        for dt in ("bf16", "fp16")
        for d in (64, 128, 256)
        for c in (False, True)
    ]
    # Variants: other tiles (timed next to the defaults), 1 and 3 consumer warpgroups, and
    # 1 and 3 stages (the ring's parity tracking with other wrap periods).
    cfgs += [
        Config("bf16", 128, 2, 176, 2, False),
        Config("bf16", 128, 2, 192, 2, False),
        Config("bf16", 128, 2, 128, 3, False),
        Config("bf16", 128, 3, 64, 2, False),
        Config("bf16", 128, 2, 176, 2, True),
        Config("bf16", 128, 2, 128, 3, True),
        Config("bf16", 128, 1, 128, 2, False),
        Config("bf16", 128, 1, 128, 2, True),
        Config("fp16", 128, 2, 128, 1, True),
        Config("bf16", 64, 3, 128, 3, False),
        Config("bf16", 64, 2, 128, 2, False),
    ]
    return cfgs


# ---------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------


def build_one(cfg: Config) -> tuple[Config, str]:
    BUILD.mkdir(parents=True, exist_ok=True)
    cubin = BUILD / f"{cfg.name}.cubin"
    cmd = ["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-O3", "--resource-usage"]
    cmd += [
        "-std=c++17",
        *[f"-I{p}" for p in INCLUDES],
        *cfg.defines(),
        str(SOURCE),
        "-o",
        str(cubin),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed for {cfg.name}:\n{log}")
    return cfg, log


def build_all(cfgs: list[Config]) -> dict[Config, str]:
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        logs = dict(pool.map(build_one, cfgs))
    for cfg, log in logs.items():
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        warn = [ln for ln in log.splitlines() if "warn" in ln.lower() or "serializ" in ln.lower()]
        print(
            f"  {cfg.name:34s} regs {regs.group(1) if regs else '?':>3}  "
            f"spill st/ld {spill.group(1) if spill else '?'}/{spill.group(2) if spill else '?'}"
            + (f"  WARN: {warn}" if warn else "")
        )
        if spill and (spill.group(1) != "0" or spill.group(2) != "0"):
            print(f"  !! {cfg.name} spills")
    return logs


# ---------------------------------------------------------------------------
# Driver API: module, tensor maps, launch
# ---------------------------------------------------------------------------


def _check(result):
    from cuda.bindings import driver

    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {err}: {msg}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


class Kernel:
    """One loaded cubin of fa3_fwd."""

    def __init__(self, cfg: Config):
        import torch
        from cuda.bindings import driver

        torch.cuda.init()
        torch.empty(1, device="cuda")  # makes torch's primary context current on this thread
        _check(driver.cuInit(0))
        self.cfg = cfg
        data = (BUILD / f"{cfg.name}.cubin").read_bytes()
        self.module = _check(driver.cuModuleLoadData(data))
        self.func = _check(driver.cuModuleGetFunction(self.module, b"fa3_fwd"))
        dptr, nbytes = _check(driver.cuModuleGetGlobal(self.module, b"fa3_launch_info"))
        info = (ctypes.c_int * 4)()
        _check(driver.cuMemcpyDtoH(ctypes.addressof(info), dptr, nbytes))
        self.threads, self.smem, self.block_m, self.block_n = list(info)
        assert self.block_m == 64 * cfg.wgs and self.block_n == cfg.block_n, (list(info), cfg)
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(self.func, attr, self.smem))

    @staticmethod
    def tensor_map(t, box_rows: int) -> bytes:
        """4-D map (head_dim, seqlen, heads, batch) over a (batch, seqlen, heads, head_dim) tensor."""
        import torch
        from cuda.bindings import driver

        b, s, h, d = t.shape
        es = t.element_size()
        if t.stride(3) != 1:
            raise ValueError("head_dim must be contiguous")
        strides = [t.stride(1) * es, t.stride(2) * es, t.stride(0) * es]
        if any(x % 16 for x in strides) or t.data_ptr() % 16:
            raise ValueError(f"TMA needs 16-byte aligned strides and base, got {strides}")
        dtype = {
            torch.bfloat16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            torch.float16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        }[t.dtype]
        tmap = _check(
            driver.cuTensorMapEncodeTiled(
                dtype,
                4,
                t.data_ptr(),
                [driver.cuuint64_t(x) for x in (d, s, h, b)],
                [driver.cuuint64_t(x) for x in strides],
                [driver.cuuint32_t(x) for x in (64, box_rows, 1, 1)],
                [driver.cuuint32_t(1)] * 4,
                driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
                driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        )
        return ctypes.string_at(tmap.getPtr(), 128)

    def __call__(self, q, k, v, o, lse, softmax_scale: float):
        """o (and lse if given) <- attention(q, k, v); tensors (batch, seqlen, heads, head_dim)."""
        import torch
        from cuda.bindings import driver

        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        assert d == self.cfg.head_dim and hq % hkv == 0
        maps = self.tensor_map(q, self.block_m) + self.tensor_map(k, self.block_n)
        maps += self.tensor_map(v, self.block_n) + self.tensor_map(o, 64)
        lse_ptr, lse_b, lse_h = (
            (lse.data_ptr(), lse.stride(0), lse.stride(1)) if lse is not None else (0, 0, 0)
        )
        fields = struct.pack(
            "<5Q14q5if",
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            o.data_ptr(),
            lse_ptr,
            *(q.stride(0), q.stride(1), q.stride(2)),
            *(k.stride(0), k.stride(1), k.stride(2)),
            *(v.stride(0), v.stride(1), v.stride(2)),
            *(o.stride(0), o.stride(1), o.stride(2)),
            lse_b,
            lse_h,
            b,
            hq,
            hkv,
            sq,
            sk,
            softmax_scale,
        )
        raw = maps + fields + bytes(24)  # no split_kv fields
        # the one FastDiv the prototype reads (its tile is the grid's), heads_q / heads_kv
        raw += struct.pack("<6I", 0, 0, 0, 0, *fast_div(hq // hkv))
        raw += bytes(768 - len(raw))  # sizeof(FwdParamsSm90), asserted in fa3_fwd.cu
        buf = ctypes.create_string_buffer(raw, 768)
        args = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        grid = (math.ceil(sq / self.block_m), hq, b)
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        _check(
            driver.cuLaunchKernel(
                self.func, *grid, self.threads, 1, 1, self.smem, stream, ctypes.addressof(args), 0
            )
        )


# ---------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------


def reference(q, k, v, causal: bool, scale: float, dtype):
    """(o, lse) computed in `dtype` for the matmuls (float32: the reference; bf16/fp16:
    PyTorch's own low-precision error, as in FlashAttention's tests). Rows that see no key
    give o = 0, lse = -inf."""
    import torch

    rep = q.shape[2] // k.shape[2]
    qf = q.to(dtype).transpose(1, 2)
    kf = k.to(dtype).repeat_interleave(rep, dim=2).transpose(1, 2)
    vf = v.to(dtype).repeat_interleave(rep, dim=2).transpose(1, 2)
    s = (qf @ kf.transpose(-1, -2)).float() * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = (p.to(dtype) @ vf).float().transpose(1, 2)
    return o, lse


def check_case(
    kern: Kernel, b, sq, sk, hq, hkv, packed=False, seed=0, scale=None
) -> tuple[bool, str]:
    import torch

    cfg = kern.cfg
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    d = cfg.head_dim
    g = torch.Generator(device="cuda").manual_seed(seed)
    if (
        packed
    ):  # q, k, v as strided views of one packed (b, s, 3, h, d) tensor (sq == sk, hq == hkv)
        qkv = torch.randn(b, sq, 3, hq, d, device="cuda", dtype=dt, generator=g)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt, generator=g)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt, generator=g)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dt, generator=g)
    o = torch.full((b, sq, hq, d), float("nan"), device="cuda", dtype=dt)
    lse = torch.full((b, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    scale = d**-0.5 if scale is None else scale
    kern(q, k, v, o, lse, scale)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference(q, k, v, cfg.causal, scale, torch.float32)
    lp_o, lp_lse = reference(q, k, v, cfg.causal, scale, dt)
    eps = 2 * (ref_o + 0.3 - 0.3 - ref_o).abs().max().item()
    err = (o.float() - ref_o).abs().max().item()
    lp_err = (lp_o - ref_o).abs().max().item()
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    lse_lp = (lp_lse[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    lse_inf_ok = bool((lse[~fin] == float("-inf")).all()) and bool(torch.isfinite(lse[fin]).all())
    ok = (
        not o.isnan().any().item()
        and err <= 2 * lp_err + eps
        and lse_err <= 2 * lse_lp + 1e-3
        and lse_inf_ok
    )
    msg = f"err {err:.2e} (lp {lp_err:.2e}) lse {lse_err:.2e} (lp {lse_lp:.2e}) nan={o.isnan().any().item()} inf_ok={lse_inf_ok}"
    return ok, msg


SEQ_PAIRS = [(1, 1), (1, 65), (113, 203), (128, 217), (200, 100), (1023, 1024), (4096, 4096)]
HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA 4, MQA


def run_tests(cfgs: list[Config], quick: bool) -> int:
    failures = 0
    total = 0
    for cfg in cfgs:
        kern = Kernel(cfg)
        for sq, sk in SEQ_PAIRS:
            big = sq * sk > 1 << 20
            if quick and big:
                continue
            for hq, hkv in HEADS[:1] if big else HEADS:
                b = 1 if big else 2
                ok, msg = check_case(kern, b, sq, sk, hq, hkv, seed=total)
                total += 1
                failures += not ok
                if not ok or big:
                    print(f"  {'ok  ' if ok else 'FAIL'} {cfg.name} {sq}x{sk} h{hq}/{hkv}: {msg}")
        ok, msg = check_case(kern, 2, 200, 200, 4, 4, packed=True, seed=total, scale=0.7)
        total += 1
        failures += not ok
        print(f"  {'ok  ' if ok else 'FAIL'} {cfg.name} packed-qkv 200x200 scale 0.7: {msg}")
    print(f"correctness: {total - failures}/{total} passed")
    return failures


# ---------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------


def time_ms(fn, warmup=3, reps=15) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def run_bench(cfgs: list[Config], seqlens: list[int], tokens: int, hidden: int) -> None:
    """TFLOP/s of each config next to SDPA's FLASH and cuDNN backends on the same inputs.
    Ours is timed twice (before and after the baselines) to show the run-to-run spread;
    the baselines are timed once per (head_dim, causal, seqlen)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    baselines: dict[tuple, dict[str, float]] = {}
    kernels = {cfg: Kernel(cfg) for cfg in cfgs}
    for cfg, kern in kernels.items():
        d = cfg.head_dim
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        h = hidden // d
        for s in seqlens:
            b = max(1, tokens // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(3))
            o = torch.empty_like(q)
            lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
            flops = 4 * b * h * s * s * d * (0.5 if cfg.causal else 1.0)
            res = {"ours": time_ms(lambda: kern(q, k, v, o, lse, d**-0.5))}
            key = (d, cfg.dtype, cfg.causal, s)
            if key not in baselines:
                baselines[key] = {}
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                for name, backend in (
                    ("flash", SDPBackend.FLASH_ATTENTION),
                    ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ):
                    try:
                        with sdpa_kernel(backend):
                            fn = lambda: F.scaled_dot_product_attention(
                                qt, kt, vt, is_causal=cfg.causal
                            )
                            baselines[key][name] = time_ms(fn)
                    except Exception as exc:  # a backend missing for this shape
                        baselines[key][name] = float("nan")
                        print(f"  {name} unavailable: {type(exc).__name__}: {str(exc)[:80]}")
            res.update(baselines[key])
            res["ours2"] = time_ms(lambda: kern(q, k, v, o, lse, d**-0.5))
            tf = {n: flops / (t * 1e-3) / 1e12 for n, t in res.items()}
            rows.append((cfg.name, s, tf))
            print(
                f"  {cfg.name:34s} b{b:<3d} h{h:<3d} s{s:<6d} ours {tf['ours']:6.1f} / {tf['ours2']:6.1f}"
                f"  flash {tf['flash']:6.1f}  cudnn {tf['cudnn']:6.1f} TFLOP/s",
                flush=True,
            )
            del q, k, v, o, lse
    print("\nsummary (TFLOP/s, bf16; ours = mean of two medians; ratio = ours / other)")
    print(
        f"{'config':34s} {'seqlen':>6s} {'ours':>6s} {'spread':>6s} {'flash':>6s} {'cudnn':>6s}"
        f" {'/flash':>6s} {'/cudnn':>6s}"
    )
    for name, s, tf in rows:
        ours = (tf["ours"] + tf["ours2"]) / 2
        spread = abs(tf["ours"] - tf["ours2"])
        print(
            f"{name:34s} {s:6d} {ours:6.1f} {spread:6.1f} {tf['flash']:6.1f} {tf['cudnn']:6.1f}"
            f" {ours / tf['flash']:6.2f} {ours / tf['cudnn']:6.2f}"
        )


def run_profile(cfgs: list[Config], seqlen: int, tokens: int, hidden: int) -> None:
    """A few launches of each config at one shape, for ncu (profile the last one)."""
    import torch

    for cfg in cfgs:
        kern = Kernel(cfg)
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        h, b = hidden // cfg.head_dim, max(1, tokens // seqlen)
        q, k, v = (
            torch.randn(b, seqlen, h, cfg.head_dim, device="cuda", dtype=dt) for _ in range(3)
        )
        o = torch.empty_like(q)
        for _ in range(3):
            kern(q, k, v, o, None, cfg.head_dim**-0.5)
        torch.cuda.synchronize()
        print(f"  {cfg.name} b{b} h{h} s{seqlen}: profiled", flush=True)


# ---------------------------------------------------------------------------
# Sanitizer run
# ---------------------------------------------------------------------------


def run_sanitize(cfgs: list[Config]) -> None:
    import torch

    for cfg in cfgs:
        kern = Kernel(cfg)
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
        for sq, sk in ((128, 300), (113, 203), (200, 100), (1, 65)):
            q = torch.randn(1, sq, 2, cfg.head_dim, device="cuda", dtype=dt)
            k = torch.randn(1, sk, 1, cfg.head_dim, device="cuda", dtype=dt)
            v = torch.randn(1, sk, 1, cfg.head_dim, device="cuda", dtype=dt)
            o = torch.empty_like(q)
            lse = torch.empty(1, 2, sq, device="cuda", dtype=torch.float32)
            kern(q, k, v, o, lse, cfg.head_dim**-0.5)
            torch.cuda.synchronize()
            print(f"  {cfg.name} {sq}x{sk}: ran, finite={bool(o.isfinite().all())}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("mode", choices=["build", "test", "bench", "sanitize", "profile", "all"])
    ap.add_argument("--quick", action="store_true", help="test: skip the large shapes")
    ap.add_argument("--seqlens", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--only", default="", help="regex on config names")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args()

    pool = all_configs()
    cfgs = [c for c in pool if re.search(args.only, c.name)]
    status = 0
    if not args.no_build:
        print(f"building {len(cfgs)} configs")
        build_all(cfgs)
    if args.mode in ("test", "all"):
        defaults = [c for c in cfgs if c == default_config(c.dtype, c.head_dim, c.causal)]
        status |= run_tests(defaults + [c for c in cfgs if c not in defaults], args.quick) != 0
    if args.mode in ("bench", "all"):
        run_bench([c for c in cfgs if c.dtype == "bf16"], args.seqlens, args.tokens, args.hidden)
    if args.mode == "sanitize":
        run_sanitize(cfgs)
    if args.mode == "profile":
        run_profile(cfgs, 8192, args.tokens, args.hidden)
    return status


if __name__ == "__main__":
    sys.exit(main())
