"""Run every example kernel once per dtype at small shapes, tails and causal corners
included (for compute-sanitizer). Kernels whose target does not run on this GPU are
skipped (and said so); the sm_90a examples also run with their mask flipped.

Usage: compute-sanitizer --tool racecheck python3 scripts/sanitize.py [NAME_REGEX]
"""

import re
import sys
from pathlib import Path

import torch

import fadsl
from fadsl.runtime.arguments import torch_dtype_of
import fadsl.targets.sm90.host.launch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from gpu_specs import general_specs, is_8bit, sm90_specs  # noqa: E402

from fadsl.runtime.attention import runs_on  # noqa: E402

# (seqlen_q, seqlen_k): whole tiles, ragged tails, and causal rows that see no key.
SHAPES = [(128, 128), (113, 203), (200, 100), (1, 65)]
# sm_90a's tile loop: more tiles than SMs (each CTA runs 3 or more, rings, Q and O barriers
# going on across tiles; 3 K/V blocks, odd against 2 stages; causal tiles with no key).
MANY_TILES = (2, 600, 333, 70, 7)  # batch, seqlen_q, seqlen_k, heads_q, heads_kv
# `cluster 2` kernels run in pairs only when a head's query blocks pair up: 6 blocks of 128
# rows (MANY_TILES' 600 rows make 5, which run alone). The runtime pairs long K/V loops only
# (fadsl.targets.sm90.host.launch.PAIR_MIN_KV_BLOCKS); this shape is paired whatever its length, so that
# racecheck stays quick.
MANY_TILES_PAIRED = (2, 768, 333, 70, 7)

# The examples, and causal versions of those that load fragment-wise and one block ahead.
# Named as their kernels are (SANITIZE_ONLY matches these names). fa3_hdim64 splits its tail
# (`tail split_kv`): MANY_TILES' last round and the (113, 203) shape's two tiles run as pieces.
SPECS = {  # (FP8 examples: scripts/sanitize_fp8.py)
    p.stem: str(p.relative_to(ROOT))
    for p in sorted((ROOT / "examples").glob("*.fa"))
    if not is_8bit(p.read_text())
}
SPECS.update(
    {n: t for n, t in general_specs().items() if n.endswith(("d256_causal", "pipelined_causal"))}
)
SPECS.update({n: t for n, t in sm90_specs().items() if n not in SPECS})  # flipped masks
ONLY = re.compile(sys.argv[1] if len(sys.argv) > 1 else "")
default = fadsl.targets.sm90.host.launch.PAIR_MIN_KV_BLOCKS

for name, spec in SPECS.items():
    if not ONLY.search(name):
        continue
    kern = fadsl.load(spec, verbose=False)
    if not runs_on(kern.config.target, 0):
        print(f"{name}: skipped ({kern.config.target} does not run on this GPU)")
        continue
    d = kern.config.head_dim
    for dtype in kern.config.dtypes:
        torch_dtype = torch_dtype_of(dtype)
        for sq, sk in SHAPES:
            q = torch.randn(1, sq, 2, d, device="cuda", dtype=torch_dtype)
            k = torch.randn(1, sk, 1, d, device="cuda", dtype=torch_dtype)
            v = torch.randn(1, sk, 1, d, device="cuda", dtype=torch_dtype)
            out, lse = kern(q, k, v, return_lse=True)
            torch.cuda.synchronize()
            print(f"{name} {dtype.value} {sq}x{sk}: ran, finite={bool(out.isfinite().all())}")
        if kern.config.target == "sm_90a" and dtype is kern.config.dtypes[0]:
            # `cluster 2`: alone (the cluster-free variant), in pairs, and the pair kernel
            # itself alone (launched directly, without its variant)
            variant = kern.alone
            runs = [(MANY_TILES, variant, "")]
            if variant is not None:
                runs += [(MANY_TILES_PAIRED, variant, " pairs"), (MANY_TILES, None, " pair kernel")]
            for shape, alone, what in runs:
                batch, sq, sk, hq, hkv = shape
                q = torch.randn(batch, sq, hq, d, device="cuda", dtype=torch_dtype)
                k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=torch_dtype)
                v = torch.randn(batch, sk, hkv, d, device="cuda", dtype=torch_dtype)
                fadsl.targets.sm90.host.launch.PAIR_MIN_KV_BLOCKS = (
                    1 if shape is MANY_TILES_PAIRED else default
                )
                kern.alone = alone
                out, lse = kern(q, k, v, return_lse=True)
                torch.cuda.synchronize()
                fadsl.targets.sm90.host.launch.PAIR_MIN_KV_BLOCKS, kern.alone = default, variant
                finite = bool(out.isfinite().all())
                print(f"{name} {dtype.value} {shape}{what}: ran, finite={finite}")
