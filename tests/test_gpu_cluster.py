"""GPU tests of `cluster 2` (sm_90a: pairs of CTAs sharing every K/V block by TMA multicast).

The kernel runs in pairs when a head's query blocks pair up and the K/V loop is long
(fadsl.targets.sm90.host.launch.launch_cluster); other launches run the spec's cluster-free variant
(``FlashAttention.alone``), and the pair kernel itself can run alone too. All three against
the float32 reference (outputs and LSE poisoned first), GQA and MQA, many tiles per CTA;
pairs forced onto odd block counts (a phantom tile past seqlen_q must store nothing); and
the persistent grid fitting the GPU's co-resident clusters.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fadsl
import fadsl.targets.sm90.host.launch as params
from fadsl import targets
from fadsl.ir import Dtype
from test_cluster_syncs import cluster_source
from test_gpu_sm90 import HOPPER, assert_matches, random_qkv

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): query blocks of 128 rows, even (pairs) or
# odd (alone); K/V tails; GQA 4 and MQA; more tiles than SMs.
PAIRED = [(1, 256, 4096, 2, 2), (2, 200, 4117, 8, 2), (1, 4096, 4096, 16, 16), (3, 1000, 5000, 6, 1),
          (2, 768, 4096, 70, 7)]  # fmt: skip
ALONE = [
    (1, 1, 65, 2, 2),
    (1, 128, 128, 2, 2),
    (2, 300, 517, 8, 2),
    (1, 2112, 2048, 16, 16),
    (7, 640, 640, 9, 3),
    (1, 256, 128, 2, 2),
]  # fmt: skip (the last: a short K/V loop)


@pytest.fixture(scope="module")
def kern():
    return fadsl.load(cluster_source(), verbose=False)


def run_case(kern, shape, dtype, seed):
    batch, sq, sk, hq, hkv = shape
    q, k, v = random_qkv(batch, sq, sk, hq, hkv, 128, dtype, seed)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, sq), float("nan"), device="cuda")
    scale = 1 / math.sqrt(128)
    kern.forward_into(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    assert_matches(kern, q, k, v, scale, out, lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", PAIRED + ALONE)
def test_pairs_and_the_variant_alone_match_the_reference(kern, shape, dtype, monkeypatch):
    pairs = params.launch_cluster(kern.compiled.kernel, shape[1], shape[2]) == 2
    assert pairs == (shape in PAIRED)
    variant = kern.alone
    launched = []
    monkeypatch.setattr(
        variant, "launch_args", lambda *args, run=variant.launch_args: launched.append(run(*args))
    )
    run_case(kern, shape, dtype, seed=sum(shape))
    assert len(launched) == (0 if pairs else 1)  # alone: the cluster-free variant ran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ALONE)
def test_the_pair_kernel_alone_matches_the_reference(kern, shape, dtype, monkeypatch):
    """Launched without its variant, the pair kernel runs as clusters of one CTA."""
    monkeypatch.setattr(kern, "alone", None)
    run_case(kern, shape, dtype, seed=3 + sum(shape))


@pytest.mark.parametrize("shape", ALONE[:4])
def test_pairs_forced_onto_odd_block_counts_store_nothing_past_seqlen_q(kern, shape, monkeypatch):
    """A pair over an odd count runs a phantom tile past seqlen_q (the kernel's num_m_blocks
    rounds up): its rows are zero-filled on load, clipped on store, and skipped for the LSE."""
    monkeypatch.setattr(params, "launch_cluster", lambda kernel, seqlen_q, seqlen_k: 2)
    # (these shapes ran alone before: the packed params' cache keys on the launch's cluster)
    run_case(kern, shape, torch.bfloat16, seed=7 + sum(shape))


def test_the_persistent_grid_fits_the_co_resident_clusters(kern):
    kern(*random_qkv(1, 256, 128, 2, 2, 128, torch.bfloat16, 3))  # loads the module
    module = kern.module(Dtype.BF16, 0)
    clusters = module.max_active_clusters(0, 2)
    assert clusters > 0 and kern._co_resident[Dtype.BF16, 0] == 2 * clusters
    assert 2 * clusters <= params.sm_count(0)


def test_a_cluster_kernel_loads_before_pytorch_touches_the_gpu():
    """module() asks the driver for co-resident clusters, which needs a current context: in
    a fresh process that has not used CUDA through PyTorch yet there is none until fadsl
    makes the primary context current (scripts/tile_trace.py loads the module first)."""
    code = (
        "import fadsl\n"
        "from fadsl.ir import Dtype\n"
        f"kern = fadsl.load({str(ROOT / 'examples' / 'fa3_hopper.fa')!r}, verbose=False)\n"
        "module = kern.module(Dtype.BF16, 0)\n"
        "print(kern._co_resident[Dtype.BF16, 0], module.attributes(0)['ctas_per_sm'])\n"
    )
    # -P: the fadsl this test imports (installed), not the source folder the cwd may be
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    co_resident, ctas_per_sm = map(int, done.stdout.split()[-2:])
    assert co_resident > 0 and ctas_per_sm == 1


def test_a_paired_launch_asks_for_clusters(kern):
    """The driver refuses an odd grid in clusters of two (CUDA_ERROR_INVALID_CLUSTER_SIZE):
    the pairs launch really carries the cluster dimension (and alone, the same grid runs)."""
    from fadsl.runtime.driver import DriverError

    q, k, v = random_qkv(1, 256, 4096, 2, 2, 128, torch.bfloat16, 5)
    out = torch.empty_like(q)
    kern(q, k, v)  # loads the module
    module = kern.module(Dtype.BF16, 0)
    launch = targets.launch_for("sm_90a")
    packed = launch.pack(kern.compiled.kernel, params.Args(q, k, v, out, None, 0.125))
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(DriverError, match="clusters of 2"):
        module.launch((3, 1, 1), launch.block(kern.compiled.kernel), packed, stream, 2)
    module.launch((3, 1, 1), launch.block(kern.compiled.kernel), packed, stream, 1)
    torch.cuda.synchronize()
