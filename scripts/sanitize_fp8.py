"""Run each FP8 kernel (issue 42) once at ragged shapes, for compute-sanitizer (racecheck,
synccheck, memcheck):

    compute-sanitizer --tool racecheck python3 -P scripts/sanitize_fp8.py [256 | 64 | varlen | kvcache | tail]

(`256`: the head_dim 256 kernels only; `64`: the head_dim 64 examples only; `varlen`: the
shipped examples with `varlen on` through fadsl.attention_varlen, head_dim 64, 128 and 256,
causal and not, long and short-query specs, a ragged packed batch with per-sequence
descales; `kvcache`: the 8-bit KV-cache specs, examples/serving/fa3_fp8_decode_paged.fa and
tests/specs/fp8/fa3_fp8_kvcache_hdim64.fa, through kern.kvcache: lengths 0, 1, 65 and 700,
one, three and automatic pieces, per-(batch, head) descales; and fadsl.attention_with_kvcache
at head_dim 256 and on pages of 16 keys, two new tokens appended; `tail`: the tail split's test
spec, tests/specs/fp8/fa3_fp8_tail_split.fa, at shapes whose tiles all run as pieces merged by
their last one.)

The shipped examples (examples/fa3_fp8_hdim128*.fa, their 128 x 128 short twins up to 1024
queries) through fadsl.attention, both 8-bit dtypes, O in bf16 and fp16, descales per (batch,
head), per tensor and none; head_dim 256 (examples/fa3_fp8_hdim256*.fa: 128 x 128 and, causal,
128 x 64) in e4m3; head_dim 64 (examples/fa3_fp8_hdim64*.fa, 128 x 256 and, causal, 128 x 192
and 128 x 128, loaded) in both; and the 8-bit test specs that build without spills
(tests/specs/fp8/: one consumer warpgroup with one stage, O in fp16), loaded, with out=.
Shapes: tails of every block size (B_r 128 or 64, B_c 192 or 128), a single query, more keys
than queries and fewer, GQA; the LSE written too."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fadsl

ROOT = Path(__file__).resolve().parents[1]
# (batch, seqlen_q, seqlen_k); 1030 queries: fadsl.attention's long specs (past 1024)
SHAPES = ((1, 1, 1), (2, 70, 333), (1, 333, 70), (2, 300, 1100), (1, 1030, 200))
HEADS, HEADS_KV, HEAD_DIM = 4, 2, 128
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# the head_dim 128 test specs (these inputs are head_dim 128)
SPECS = ("fa3_fp8_one_wg", "fa3_fp8_hdim128_fp16")


def inputs(batch: int, sq: int, sk: int, dtype):
    q = torch.randn(batch, sq, HEADS, HEAD_DIM, device="cuda").to(dtype)
    k = torch.randn(batch, sk, HEADS_KV, HEAD_DIM, device="cuda").to(dtype)
    v = torch.randn(batch, sk, HEADS_KV, HEAD_DIM, device="cuda").to(dtype)
    return q, k, v


def descales(batch: int, kind: int):
    """None, a per-tensor descale (an expanded scalar), or one per (batch, head)."""
    if kind == 0:
        return None, None, None
    if kind == 1:
        one = torch.tensor([0.5], device="cuda").expand(batch, HEADS_KV)
        return one, one, one
    return tuple(torch.rand(batch, HEADS_KV, device="cuda") + 0.5 for _ in range(3))


# the head_dim 64 examples, loaded
HEAD_DIM_64 = ("fa3_fp8_hdim64", "fa3_fp8_hdim64_causal", "fa3_fp8_hdim64_causal_short")
# the parts a run covers: the shipped head_dim 128 calls and the test specs, 256, 64
PARTS = {
    "": {"128", "256", "64", "tail"},
    "256": {"256"},
    "64": {"64"},
    "varlen": {"varlen"},
    "kvcache": {"kvcache"},
    "tail": {"tail"},
}[" ".join(sys.argv[1:])]
# varlen: (query rows, keys) per sequence: a single row, no row, no key, tails off the tiles
VARLEN = ((1, 1), (300, 170), (0, 5), (129, 0), (500, 700))

with torch.no_grad():
    for name, dtype in DTYPES.items() if "128" in PARTS else ():
        for causal in (False, True):
            for out_dtype in (torch.bfloat16, torch.float16):
                for i, (batch, sq, sk) in enumerate(SHAPES):
                    q, k, v = inputs(batch, sq, sk, dtype)
                    qd, kd, vd = descales(batch, i % 3)
                    out, lse = fadsl.attention(q, k, v, causal, return_lse=True, q_descale=qd,
                                               k_descale=kd, v_descale=vd,
                                               out_dtype=out_dtype)  # fmt: skip
                    torch.cuda.synchronize()
                    finite = bool(out.isfinite().all())
                    print(f"fadsl.attention {name} causal={causal} {out_dtype} {batch}x{sq}x{sk}: "
                          f"ran, finite={finite}")  # fmt: skip
    for causal in (False, True) if "256" in PARTS else ():  # head_dim 256: the two examples
        for batch, sq, sk in SHAPES:
            q, k, v = (torch.randn(batch, n, h, 256, device="cuda").to(torch.float8_e4m3fn)
                       for n, h in ((sq, HEADS), (sk, HEADS_KV), (sk, HEADS_KV)))  # fmt: skip
            out = fadsl.attention(q, k, v, causal)
            torch.cuda.synchronize()
            print(f"fadsl.attention e4m3 d 256 causal={causal} {batch}x{sq}x{sk}: ran, "
                  f"finite={bool(out.isfinite().all())}")  # fmt: skip
    for spec in HEAD_DIM_64 if "64" in PARTS else ():
        kern = fadsl.load(ROOT / "examples" / f"{spec}.fa", verbose=False)
        for dtype in kern.config.dtypes:
            for i, (batch, sq, sk) in enumerate(SHAPES):
                q, k, v = (torch.randn(batch, n, h, 64, device="cuda").to(DTYPES[dtype.value])
                           for n, h in ((sq, HEADS), (sk, HEADS_KV), (sk, HEADS_KV)))  # fmt: skip
                qd, kd, vd = descales(batch, i % 3)
                _, lse = kern(q, k, v, return_lse=True, q_descale=qd, k_descale=kd,
                              v_descale=vd)  # fmt: skip
                torch.cuda.synchronize()
                print(
                    f"{spec} {dtype.value} {batch}x{sq}x{sk}: ran, finite={bool(lse.isfinite().all())}"
                )
    for spec in SPECS if "128" in PARTS else ():
        kern = fadsl.load(ROOT / "tests" / "specs" / "fp8" / f"{spec}.fa", verbose=False)
        for dtype in kern.config.dtypes:
            for i, (batch, sq, sk) in enumerate(SHAPES):
                q, k, v = inputs(batch, sq, sk, DTYPES[dtype.value])
                qd, kd, vd = descales(batch, i % 3)
                out = torch.empty(q.shape, device="cuda", dtype=kern.out_torch_dtype)
                _, lse = kern(q, k, v, out=out, return_lse=True, q_descale=qd, k_descale=kd,
                              v_descale=vd)  # fmt: skip
                torch.cuda.synchronize()
                print(
                    f"{spec} {dtype.value} {batch}x{sq}x{sk}: ran, finite={bool(out.isfinite().all())}"
                )
    if "tail" in PARTS:  # tail split_kv: (batch, seqlen_q, seqlen_k) of 12 and 24 tiles, split
        kern = fadsl.load(ROOT / "tests/specs/fp8/fa3_fp8_tail_split.fa", verbose=False)
        for dtype in kern.config.dtypes:
            for i, (batch, sq, sk) in enumerate(((1, 333, 4096), (2, 300, 1100))):
                q, k, v = inputs(batch, sq, sk, DTYPES[dtype.value])
                qd, kd, vd = descales(batch, 2 - i)
                out, lse = kern(q, k, v, return_lse=True, q_descale=qd, k_descale=kd,
                                v_descale=vd)  # fmt: skip
                torch.cuda.synchronize()
                print(f"fa3_fp8_tail_split {dtype.value} {batch}x{sq}x{sk}: ran, "
                      f"finite={bool(out.isfinite().all())}")  # fmt: skip
    for head_dim in (64, 128, 256) if "varlen" in PARTS else ():
        rows, keys = zip(*VARLEN)
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda") for n in (rows, keys))  # fmt: skip
        q, k, v = (torch.randn(sum(n), h, head_dim, device="cuda").to(torch.float8_e4m3fn)
                   for n, h in ((rows, HEADS), (keys, HEADS_KV), (keys, HEADS_KV)))  # fmt: skip
        qd, kd, vd = descales(len(VARLEN), 2)
        # max_seqlen_q None: the long spec; 500: the short-query one where there is one
        for causal, longest in ((False, None), (True, None), (False, 500), (True, 500)):
            out, lse = fadsl.attention_varlen(q, k, v, cu_q, cu_k, longest, None, causal,
                                              q_descale=qd, k_descale=kd, v_descale=vd,
                                              return_lse=True)  # fmt: skip
            torch.cuda.synchronize()
            print(f"fadsl.attention_varlen e4m3 d {head_dim} causal={causal} max_seqlen_q="
                  f"{longest}: ran, finite={bool(out.isfinite().all())}")  # fmt: skip
    for spec, hq, d in (("examples/serving/fa3_fp8_decode_paged.fa", 8, 128),
                        ("tests/specs/fp8/fa3_fp8_kvcache_hdim64.fa", 4, 64)) if "kvcache" in PARTS else ():  # fmt: skip
        kern = fadsl.load(ROOT / spec, verbose=False)
        page = kern.config.ext.kv_cache
        lengths = torch.tensor([0, 1, 65, 700], dtype=torch.int32, device="cuda")
        dtype = DTYPES[kern.config.dtypes[0].value]
        if page:
            k = torch.randn(4 * 12, page, HEADS_KV, d, device="cuda").to(dtype)
            table = torch.randperm(48, device="cuda").view(4, 12).to(torch.int32)
        else:
            k, table = torch.randn(4, 768, HEADS_KV, d, device="cuda").to(dtype), None
        v = torch.randn_like(k, dtype=torch.float32).to(dtype)
        qd, kd, vd = descales(4, 2)
        for sq, splits in ((1, None), (3, 1), (3, 3)):
            q = torch.randn(4, sq, hq, d, device="cuda").to(dtype)
            out, lse = kern.kvcache(q, k, v, lengths, table, num_splits=splits, return_lse=True,
                                    q_descale=qd, k_descale=kd, v_descale=vd)  # fmt: skip
            torch.cuda.synchronize()
            print(f"{Path(spec).stem} kvcache seqlen_q {sq} splits {splits}: ran, "
                  f"finite={bool(out.isfinite().all())}")  # fmt: skip
    # fadsl.attention_with_kvcache's own choices where the example's B_c 256 does not build:
    # head_dim 256 (B_c 64) and pages of 16 keys (B_c 128), two new tokens appended
    for d, page in ((256, 64), (128, 16)) if "kvcache" in PARTS else ():
        per = -(-702 // page)
        k = torch.randn(4 * per, page, HEADS_KV, d, device="cuda").to(torch.float8_e4m3fn)
        v = torch.randn_like(k, dtype=torch.float32).to(torch.float8_e4m3fn)
        table = torch.randperm(4 * per, device="cuda").view(4, per).to(torch.int32)
        q = torch.randn(4, 2, 8, d, device="cuda").to(torch.float8_e4m3fn)
        new = torch.randn(4, 2, HEADS_KV, d, device="cuda").to(torch.float8_e4m3fn)
        lengths = torch.tensor([0, 1, 65, 700], dtype=torch.int32, device="cuda")
        qd, kd, vd = descales(4, 2)
        out = fadsl.attention_with_kvcache(q, k, v, lengths, new, new, page_table=table,
                                           causal=True, q_descale=qd, k_descale=kd,
                                           v_descale=vd)  # fmt: skip
        torch.cuda.synchronize()
        print(f"fadsl.attention_with_kvcache e4m3 d {d} page {page}: ran, "
              f"finite={bool(out.isfinite().all())}")  # fmt: skip
