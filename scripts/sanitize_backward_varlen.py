"""One small forward and backward of fadsl.attention_varlen per varlen backward kernel (the
serving specs' backward blocks, a causal window, softcap, GQA), on a ragged packed batch
(lengths 70, 1, 200, 0, 129: an empty sequence, one row, tails), rows outside every
sequence with unequal q and k, and malformed cu_seqlens, for compute-sanitizer:
compute-sanitizer --tool racecheck python3 -P scripts/sanitize_backward_varlen.py [REGEX]
(REGEX: only the cases whose names it matches)."""

import re
import sys

import torch

import fadsl

ONLY = re.compile(sys.argv[1] if len(sys.argv) > 1 else "")
LENGTHS = [70, 1, 200, 0, 129]
# name: (head_dim, causal, window_size, softcap, heads_q, heads_kv)
CASES = {
    "causal_hd128": (128, True, (-1, -1), 0, 4, 4),
    "none_hd64": (64, False, (-1, -1), 0, 4, 4),
    "causal_window32_hd128": (128, True, (32, 0), 0, 4, 4),
    "softcap30_hd128": (128, False, (-1, -1), 30, 4, 4),
    "causal_softcap30_hd128": (128, True, (-1, -1), 30, 4, 4),
    "gqa4_causal_hd128": (128, True, (-1, -1), 0, 8, 2),
}
# `fused_convert on` (dQ converted by each sequence's last CTA, keyless chunks zeroed by the
# preprocess): the serving specs with the knob, loaded when their case runs
FUSED_SPECS = {"fused_causal_hd128": "fa3_varlen_causal", "fused_none_hd64": "fa3_varlen_hdim64"}
CASES["fused_causal_hd128"] = (128, True, (-1, -1), 0, 8, 2)
CASES["fused_none_hd64"] = (64, False, (-1, -1), 0, 4, 4)
FUSED = {}
for case, spec in FUSED_SPECS.items():
    if ONLY.search(case):
        text = open(f"examples/serving/{spec}.fa").read()
        FUSED[case] = fadsl.load(text.replace("backward {", "backward {\n    fused_convert on", 1))
cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
# (rows of q, rows of k, cu_seqlens_q, cu_seqlens_k) of each case's batches: the lengths
# above; then unequal q and k with rows outside every sequence (slots and chunks before the
# first sequence, a sequence with keys and no query); then a malformed one (decreasing, and
# past the tensor: the forward's output is NaN, the backward reads and writes in bounds)
BATCHES = [
    (sum(LENGTHS), sum(LENGTHS), cu, cu),
    (800, 900, [300, 430, 430, 600], [260, 400, 460, 700]),
    (400, 400, [0, 250, 200, 400], [0, 100, 300, 500]),
]
for name, (d, causal, window_size, softcap, hq, hkv) in CASES.items():
    if not ONLY.search(name):
        continue
    for rows_q, rows_k, starts_q, starts_k in BATCHES:
        cu_q, cu_k = (
            torch.tensor(c, dtype=torch.int32, device="cuda") for c in (starts_q, starts_k)
        )
        q, dout = (
            torch.randn(rows_q, hq, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)
        )
        k, v = (torch.randn(rows_k, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        if name in FUSED:  # a loaded serving spec with `fused_convert on`
            try:
                out = FUSED[name].varlen(*leaves, cu_q, cu_k)
            except (ValueError, RuntimeError) as error:  # malformed cu_seqlens refused up front
                assert "cu_seqlens" in str(error), error
                print(name, starts_q, "refused:", error)
                continue
        else:
            out = fadsl.attention_varlen(
                *leaves, cu_q, cu_k, causal=causal, window_size=window_size, softcap=softcap
            )
        out.backward(dout)
        torch.cuda.synchronize()
        sums = [float(t.grad.float().abs().sum()) for t in leaves]
        print(name, starts_q, "ok", sums)
torch.cuda.synchronize()
