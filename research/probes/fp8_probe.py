"""Where fadsl's FP8 forward (examples/fa3_fp8_hdim128.fa, e4m3) loses its time: one variant
a process, built as a development cubin from source patches (the repository is untouched),
timed at hidden 2048 / 16k tokens with the SM clock and power sampled (fadsl/tools/clocks).

research/fp8-forward.md §9 (2026-11-30) plans its runs. Usage:
  python3 -P fp8_probe.py --variant base --seqlens 1024,4096,16384      (GPU)
  python3 -P fp8_probe.py --variant pin --build-only                     (CPU: ptxas, SASS)
  for v in base no_exp2 ...; do python3 -P fp8_probe.py --variant $v; done

Variants (timing-only ones give wrong O; "exact" ones must match base bit for bit):
  base          the shipped kernel
  no_exp2       every ex2.approx -> one FFMA giving 1.0 (MUFU.EX2 gone; P = 1, no rescale)
  no_cvt        pack_e4m3x4's two cvt.rn.satfinite.e4m3x2 -> LOP3/PRMT (F2FP gone)
  no_transpose  transpose_v returns at once (the producer keeps every sync)
  (--spec examples/fa3_fp8_hdim256.fa: the variants of that spec; on 2026-12-04 its
  no_transpose ran 1.57-1.65x base, which led to transpose_v_lean's x4 loads)
  no_sum        the row sums' FADDs gone (timing only: what a sum by the tensor cores could save)
  slack8        kRescaleSlack 0.8 -> 8 (almost no O rescale; P clamps at 448: timing only)
  pin           exact: the K-slot release after online_softmax8, on !(l[0] < 0) (ptxas then
                keeps every exponential between the S wait and the P V wait: 391 vs 67)
  pin_clean     exact: pin's place for the exponentials without moving K's release (a branch
                on the row sums that never runs for finite scores)
  ilp2          exact: transpose_v loads two 16-key units before storing them
  vds_early     exact: v_descale loaded at the tile's start, not in the epilogue
  fixes         exact: pin + ilp2 + vds_early
  bc128, bc128s3  B_c 128 (stages 2 / 3): no padding at 1k (1024 = 8 x 128)
  poly2, poly3, poly4, poly8  every K-th exponential of a row by a polynomial on the FMA pipe
                (not exact: --check prints its distance from base)
  bf16          the shipped bf16 kernel (fadsl.attention), the reference
  A+B           both variants' patches (source patches only), e.g. pin_clean+no_sum
  pin_define    exact: FADSL_EXP_PIN=1 (apply `git show 50cd6ec:research/patches/softmax-pin.patch`)
  sum_mma       FADSL_EXP_SUM_MMA=1 (apply `git show 50cd6ec:research/patches/fp8-sum-mma.patch`): the
                row sums by the tensor cores, P x 8 columns of e4m3 ones (not bitwise: --check
                prints its distance from base)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent
for cand in (pathlib.Path.cwd(), pathlib.Path("/work/main")):
    if (cand / "fadsl").is_dir():
        sys.path.insert(0, str(cand))
        ROOT = cand
        break

SPEC = ROOT / "examples" / "fa3_fp8_hdim128.fa"

# ---- source patches: (file suffix or "KERNEL", old, new) -------------------------------------
EXP2_OLD = 'asm("ex2.approx.ftz.f32 %0, %1;\\n" : "=f"(y) : "f"(x));'
CVT_OLD = """  asm("{\\n"
      "  .reg .b16 lo, hi;\\n"
      "  cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\\n"  // the first operand lands in the high byte
      "  cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\\n"
      "  mov.b32 %0, {lo, hi};\\n"
      "}\\n"
      : "=r"(packed)
      : "f"(a), "f"(b), "f"(c), "f"(d));"""
TRANSPOSE_ENTRY = (
    "__device__ __forceinline__ void transpose_v(uint32_t smem_v_slot, uint32_t smem_vt_slot, "
    "int warp, int lane) {\n"
)
UNIT_LOOP_OLD = """#pragma unroll 1
    for (int k0 = 0; k0 < Cfg::kBlockN; k0 += 16) {
      uint32_t x[4];
      ldmatrix_x4_trans(raw + k0 * Cfg::kRowBytes, x);
      stmatrix_x4(vt + (k0 / kPanel) * kVtPanelBytes + ((k0 % kPanel) ^ st_xor), __byte_perm(x[0], x[1], 0x6420),
                  __byte_perm(x[0], x[1], 0x7531), __byte_perm(x[2], x[3], 0x6420), __byte_perm(x[2], x[3], 0x7531));
    }"""
UNIT_LOOP_ILP2 = """#pragma unroll 1
    for (int k0 = 0; k0 < Cfg::kBlockN; k0 += 32) {
      uint32_t x[4], y[4];
      ldmatrix_x4_trans(raw + k0 * Cfg::kRowBytes, x);
      ldmatrix_x4_trans(raw + (k0 + 16) * Cfg::kRowBytes, y);
      stmatrix_x4(vt + (k0 / kPanel) * kVtPanelBytes + ((k0 % kPanel) ^ st_xor), __byte_perm(x[0], x[1], 0x6420),
                  __byte_perm(x[0], x[1], 0x7531), __byte_perm(x[2], x[3], 0x6420), __byte_perm(x[2], x[3], 0x7531));
      const int k1 = k0 + 16;
      stmatrix_x4(vt + (k1 / kPanel) * kVtPanelBytes + ((k1 % kPanel) ^ st_xor), __byte_perm(y[0], y[1], 0x6420),
                  __byte_perm(y[0], y[1], 0x7531), __byte_perm(y[2], y[3], 0x6420), __byte_perm(y[2], y[3], 0x7531));
    }"""
PIN_OLD = """        // hazard WAR on K: qk -> k_g2s across the loop back edge (consumers -> producer)
        if (lane == 0) mbar_arrive(bar_k_empty(ring_slot(ring_base + it)));
        // mask (leading iterations only) and online softmax of S in place
        if constexpr (kMask) mask_scores<Cfg>(s, P.base, rows, w.n_blocks - 1 - (it), lane);
        online_softmax8<Cfg>(s, m, l, scale, scale_log2);
"""
PIN_NEW = """        // mask (leading iterations only) and online softmax of S in place
        if constexpr (kMask) mask_scores<Cfg>(s, P.base, rows, w.n_blocks - 1 - (it), lane);
        online_softmax8<Cfg>(s, m, l, scale, scale_log2);
        // PROBE pin: K released after the exponentials, on a test ptxas cannot fold (true for NaN)
        if (lane == 0 && !(l[0] < 0.f)) mbar_arrive(bar_k_empty(ring_slot(ring_base + it)));
"""
PIN_CLEAN_OLD = """        online_softmax8<Cfg>(s, m, l, scale, scale_log2);
"""
PIN_CLEAN_NEW = """        online_softmax8<Cfg>(s, m, l, scale, scale_log2);
        // PROBE pin_clean: a branch on both rows' sums that never runs for finite scores (l >= 0;
        // false for NaN), so ptxas keeps the exponentials above the P V wait; K's release stays.
        // The vote keeps the branch warp-uniform (a divergent one cost the loop its uniform
        // datapath: 47 uniform instructions moved to the vector pipes)
        if (__any_sync(0xffffffffu, fminf(l[0], l[1]) < -1.f)) asm volatile("trap;");
"""
VDS_OLD_1 = "      const float scale_log2 = fp8_scale_log2<Cfg>(P.base, D, w);\n"
VDS_NEW_1 = (
    VDS_OLD_1
    + "      const float v_descale_early = fp8_v_descale<Cfg>(D, w);  // PROBE vds_early\n"
)
VDS_OLD_2 = "normalize_o8<Cfg>(o, l, fp8_v_descale<Cfg>(D, w));"
VDS_NEW_2 = "normalize_o8<Cfg>(o, l, v_descale_early);"

PATCHES = {
    "no_exp2": [("sm90_ptx.cuh", EXP2_OLD, "y = __fmaf_rn(x, 0.f, 1.f);")],
    "no_cvt": [
        (
            "sm90_fp8_consumer.cuh",
            CVT_OLD,
            "  packed = __byte_perm(__float_as_uint(a) ^ __float_as_uint(b), "
            "__float_as_uint(c) ^ __float_as_uint(d), 0x7531);",
        )
    ],
    "no_transpose": [("sm90_fp8.cuh", TRANSPOSE_ENTRY, TRANSPOSE_ENTRY + "  return;  // PROBE\n")],
    "slack8": [("sm90_fp8.cuh", "kRescaleSlack = 0.8f;", "kRescaleSlack = 8.f;")],
    # the row sums' FADDs gone (sum of the first column pair only): what a row sum taken by the
    # tensor cores (a column of ones beside V's in Vt, P V at n + 8) would save at most
    "no_sum": [("sm90.cuh", "      sum += x;\n", "      if (j == 0) sum += x;\n")],
    "pin": [("KERNEL", PIN_OLD, PIN_NEW)],
    "pin_clean": [("KERNEL", PIN_CLEAN_OLD, PIN_CLEAN_NEW)],
    "ilp2": [("sm90_fp8.cuh", UNIT_LOOP_OLD, UNIT_LOOP_ILP2)],
    "vds_early": [("KERNEL", VDS_OLD_1, VDS_NEW_1), ("KERNEL", VDS_OLD_2, VDS_NEW_2)],
}
PATCHES["fixes"] = PATCHES["pin"] + PATCHES["ilp2"] + PATCHES["vds_early"]

# polyK: every K-th exponential of a row (the j-th column pair with j % K == K - 1) by a
# degree-3 polynomial on the FMA pipe instead of MUFU.EX2 (FlashAttention-4's trick on
# Blackwell): 2^x = 2^round(x) 2^f, f in [-1/2, 1/2], p(f) within 7.5e-5 of 2^f (relative,
# a reweighted least-squares fit), round(x) by the 1.5 * 2^23 addition and added to p's
# exponent field; x clamped at -125 so the result stays a normal float (NaN passes: the
# compare is false). Timing and error probe: not exact.
POLY_FN = """
__device__ __forceinline__ float poly_exp2(float x) {
  x = x < -125.f ? -125.f : x;
  const float t = __fadd_rn(x, 12582912.f);
  const float f = __fsub_rn(x, __fsub_rn(t, 12582912.f));
  const float p = fmaf(fmaf(fmaf(5.517030467e-02f, f, 2.426100414e-01f), f, 6.932610846e-01f), f,
                       9.999281509e-01f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

"""
EXP2_ROW_HEAD = "template <class Cfg>\n__device__ __forceinline__ float exp2_row("
EXP2_ROW_OLD = "      x = fast_exp2(fmaf(x, scale_log2, -ref));"


def _poly(k: int) -> list:
    new = (
        f"      x = (j % {k} == {k - 1}) ? poly_exp2(fmaf(x, scale_log2, -ref))"
        " : fast_exp2(fmaf(x, scale_log2, -ref));"
    )
    return [
        ("sm90.cuh", EXP2_ROW_HEAD, POLY_FN + EXP2_ROW_HEAD),
        ("sm90.cuh", EXP2_ROW_OLD, new),
    ]


for _k in (2, 3, 4, 8):
    PATCHES[f"poly{_k}"] = _poly(_k)
SPEC_EDITS = {
    "bc128": ("B_c = 192", "B_c = 128", None),
    "bc128s3": ("B_c = 192", "B_c = 128", ("stages     2", "stages     3")),
}
# Variants that are defines of a development build: apply their patch first (`git show
# 50cd6ec:research/patches/NAME.patch | git apply`; both timed without gain on 2026-12-05 and
# removed); with both applied, "pin_define+sum_mma" sets both.
DEFINES = {
    "pin_define": {"FADSL_EXP_PIN": 1},  # softmax-pin.patch
    "sum_mma": {"FADSL_EXP_SUM_MMA": 1},  # fp8-sum-mma.patch
}
EXACT = {"pin", "pin_clean", "pin_define", "ilp2", "vds_early", "fixes"}


def spec_path(variant: str, tmp: pathlib.Path) -> pathlib.Path:
    if variant not in SPEC_EDITS:
        return SPEC
    old, new, more = SPEC_EDITS[variant]
    text = SPEC.read_text().replace(old, new)
    if more:
        text = text.replace(*more)
    text = text.replace("kernel fa3_fp8_hdim128 ", f"kernel fa3_fp8_hdim128_{variant} ")
    path = tmp / f"fa3_fp8_hdim128_{variant}.fa"
    path.write_text(text)
    return path


def build(kern, dtype, arch: str, variant: str, defines: dict | None = None):
    """The variant's cubin as the kernel's development build (use_development_build's way)."""
    from fadsl.build import cache, nvrtc

    patches = [x for part in variant.split("+") for x in PATCHES.get(part, [])]  # a+b: both
    request = kern.request(dtype, arch)
    text = request.text
    for where, old, new in patches:
        if where == "KERNEL":
            assert old in text, (variant, old[:60])
            text = text.replace(old, new)
    header_patches = [p for p in patches if p[0] != "KERNEL"]
    original = nvrtc.fadsl_headers

    def patched():
        headers = dict(original())
        for suffix, old, new in header_patches:
            hits = [k for k in headers if k.endswith(suffix)]
            assert hits and all(old in headers[k] for k in hits), (variant, suffix, old[:60])
            for k in hits:
                headers[k] = headers[k].replace(old, new)
        return headers

    nvrtc.fadsl_headers = patched
    try:
        entry = cache.development_build(dataclasses.replace(request, text=text), defines or {})
    finally:
        nvrtc.fadsl_headers = original
    for k in kern.variants:
        k._entries[dtype, arch] = entry
    return entry


def sass_summary(entry) -> dict:
    from fadsl.build.nvrtc import parse_resource_usage
    from fadsl.tools import sass

    if (
        not entry.log.strip()
    ):  # a cache hit keeps no compiler report: the --build-only run printed it
        return {}
    text = sass.disassemble(entry.cubin, sass.nvdisasm())
    loops = sass.mainloops(text)
    out = {"ptxas": dataclasses.asdict(parse_resource_usage(entry.log))}
    out["mainloops"] = [
        {
            "len": len(lp.instructions),
            "overlap": sass.softmax_overlap(lp),
            "mufu": lp.count("MUFU.EX2"),
            "f2fp": lp.count("F2FP"),
            "qgmma": lp.count("QGMMA"),
        }
        for lp in loops
    ]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", default="base")
    p.add_argument("--spec", type=pathlib.Path, help="an 8-bit spec (default fa3_fp8_hdim128)")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--check", action="store_true", help="exact variants: O equal to base's")
    p.add_argument("--json")
    p.add_argument("--trace", action="store_true", help="FADSL_TILE_TRACE build: the tile timeline")
    args = p.parse_args()
    if args.spec is not None:
        global SPEC
        SPEC = args.spec.resolve()

    import torch

    import fadsl
    from fadsl.ir import Dtype
    from fadsl.tools import clocks

    e4m3 = Dtype("e4m3")
    tmp = pathlib.Path(tempfile.mkdtemp())
    result = {"variant": args.variant, "rows": []}
    if args.variant != "bf16":
        kern = fadsl.load(str(spec_path(args.variant, tmp)), verbose=False)
        arch = "sm_90a"
        defines = {"FADSL_TILE_TRACE": 1} if args.trace else {}
        for part in args.variant.split("+"):
            defines.update(DEFINES.get(part, {}))
        entry = build(kern, e4m3, arch, args.variant, defines or None)
        result["sass"] = sass_summary(entry)
        print(args.variant, json.dumps(result["sass"]))
        if args.check:
            base = fadsl.load(str(SPEC), verbose=False)
    if args.build_only:
        return 0

    reader = clocks.nvml_reader()
    sampler = clocks.Sampler(reader) if reader else None
    d = kern.config.head_dim if args.variant != "bf16" else 128
    heads = args.hidden // d
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        batch = max(1, args.tokens // seqlen)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(batch, seqlen, heads, d, device="cuda", generator=g) for _ in range(3)
        )
        if args.variant == "bf16":
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
            call = lambda: fadsl.attention(q, k, v)  # noqa: E731
        else:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            ds = torch.ones(batch, heads, device="cuda", dtype=torch.float32)
            call = lambda: kern(q, k, v, q_descale=ds, k_descale=ds, v_descale=ds)  # noqa: E731
        out = call()
        torch.cuda.synchronize()
        if args.check and args.variant != "bf16":  # exact ones print 0, the others a distance
            ref = base(q, k, v, q_descale=ds, k_descale=ds, v_descale=ds)
            exact = all(part in EXACT for part in args.variant.split("+"))
            print(
                f"  check {seqlen}: max |O - O_base| = {(out.float() - ref.float()).abs().max().item()}"
                + (" (an exact variant: must be 0)" if exact else "")
            )
        for _ in range(args.warmup):
            call()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.runs)]
        if sampler:
            sampler.start()
        for i in range(args.runs):
            starts[i].record()
            call()
            ends[i].record()
        torch.cuda.synchronize()
        readings = sampler.stop() if sampler else []
        ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
        tflops = 4 * batch * heads * seqlen * seqlen * d / (ms * 1e-3) / 1e12
        summ = clocks.summarize(readings)
        if args.trace and args.variant != "bf16":
            from fadsl.tools import tiletrace

            module = kern.module(e4m3, 0)
            module.zero_global("fadsl_tile_trace")
            call()
            torch.cuda.synchronize()
            layout = tiletrace.TraceLayout.of_target(kern.compiled.target)
            timeline = tiletrace.phases(
                layout.unpack(module.read_global("fadsl_tile_trace")), layout
            )
            if timeline is not None:
                print(tiletrace.report(timeline, math.ceil(seqlen / kern.config.block_c)))
        row = {
            "seqlen": seqlen,
            "ms": ms,
            "tflops": tflops,
            "mhz": summ.sm_mhz if summ else None,
            "watts": summ.power_w if summ else None,
            "capped": summ.power_capped if summ else None,
        }
        row["tflops_per_ghz"] = tflops / (row["mhz"] / 1000) if row["mhz"] else None
        result["rows"].append(row)
        print(
            f"  {args.variant:13s} {seqlen:6d}: {tflops:6.0f} TF/s  {ms:8.3f} ms  "
            + (summ.text() if summ else "no clocks")
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
