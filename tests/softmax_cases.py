"""Adversarial score sequences for the online softmax, shared by the CPU model's tests
(tests/test_softmax_model.py, through hypothesis) and the GPU numerics suite
(tests/test_gpu_numerics.py, which sets the scores exactly: q = e_i, k_j[i] = score).

A case is a batch of warps, each 16 query rows over ``n_blocks`` blocks of ``block_n`` keys.
Rows start from a base (0, moderate, very negative or large) with some noise; jumps raise
chosen keys of chosen rows, in a chosen block of the visit order (the kernel visits the last
key block first), by a size drawn from each threshold's bucket or placed on a threshold and
just either side of it; a prefix of the visited blocks may be masked, leaving rows that see
few keys, no key yet when the unmasked blocks begin, or no key at all. Every score is a
bf16 value that fp16 holds too (|s| <= 65504, no fp16 subnormal), so that one-hot queries
give exactly these scores in both dtypes.
"""

from __future__ import annotations

import math
import random

import torch

SLACK = 8.0
MOVE_LIMIT = 120.0  # log2 of kGuardedMoveSum
RCP_WINDOW = (126.0, 128.0)  # 1 / P is subnormal for P in (2^126, 2^128)


def guard_bound_log2(block_n: int) -> float:
    """log2 of the guarded path's bound on a thread's row sum, (B_c / 4) 2^8."""
    return SLACK + math.log2(block_n / 4)


def buckets(block_n: int) -> dict[str, tuple[float, float]]:
    """Jump sizes (log2 units above the row's largest score so far), one range between each
    pair of thresholds."""
    bound = guard_bound_log2(block_n)
    return {
        "within_slack": (0.0, SLACK),
        "past_slack": (SLACK, bound),
        "past_bound": (bound, MOVE_LIMIT),
        "past_move_limit": (MOVE_LIMIT, RCP_WINDOW[0]),
        "rcp_window": RCP_WINDOW,
        "overflow": (RCP_WINDOW[1], 300.0),
        "huge": (300.0, 20000.0),
    }


def edges(block_n: int) -> list[float]:
    """Each threshold a jump can cross."""
    return [SLACK, guard_bound_log2(block_n), MOVE_LIMIT, *RCP_WINDOW]


EDGE_OFFSETS = (-0.5, -0.0625, 0.0, 0.0625, 0.5)
FP16_MAX = 65504.0


def exact16(x: torch.Tensor) -> torch.Tensor:
    """x as bf16 values that fp16 holds exactly too (clamped to fp16's range, fp16
    subnormals to 0); -inf stays."""
    finite = x.isfinite()
    y = x.clamp(-FP16_MAX, FP16_MAX).to(torch.bfloat16).to(torch.float32)
    y = torch.where(y.abs() < 2.0**-14, torch.zeros_like(y), y)
    y = y.clamp(-65280.0, 65280.0)  # the largest bf16 below fp16's max
    return torch.where(finite, y, x)


def jump_size(rng: random.Random, block_n: int) -> float:
    if rng.random() < 0.4:
        return max(0.0, rng.choice(edges(block_n)) + rng.choice(EDGE_OFFSETS))
    lo, hi = rng.choice(list(buckets(block_n).values()))
    return rng.uniform(lo, hi)


def thread_keys(block_n: int, thread: int) -> list[int]:
    """The keys (within a block) that one thread of a quad holds: 8j + 2t + e."""
    return [8 * j + 2 * thread + e for j in range(block_n // 8) for e in range(2)]


def _jump_keys(rng: random.Random, block_n: int) -> list[int]:
    kind = rng.choice(["one", "pair", "thread", "block", "spread"])
    if kind == "one":
        return [rng.randrange(block_n)]
    if kind == "pair":  # two keys of one thread: its sum doubles
        keys = thread_keys(block_n, rng.randrange(4))
        return rng.sample(keys, 2)
    if kind == "thread":
        return thread_keys(block_n, rng.randrange(4))
    if kind == "block":
        return list(range(block_n))
    return rng.sample(range(block_n), rng.randint(2, min(8, block_n)))


def _rows(rng: random.Random) -> list[int]:
    kind = rng.choice(["one", "some", "all", "quad"])
    if kind == "one":
        return [rng.randrange(16)]
    if kind == "all":
        return list(range(16))
    if kind == "quad":  # rows r and r + 8 belong to the same quad of threads
        r = rng.randrange(8)
        return [r, r + 8]
    return rng.sample(range(16), rng.randint(2, 15))


def random_warp(rng: random.Random, block_n: int, n_blocks: int, masks: bool = True):
    """One warp's scores (16, n_blocks * block_n), raw (the model's c is about 1 for
    softmax_scale ln 2), in key order; and a label of what it holds."""
    keys = n_blocks * block_n
    base = rng.choice([0.0, 0.0, rng.uniform(-60.0, 60.0), -30000.0, -1000.0, 2000.0])
    noise = rng.choice([0.0, 0.0, 0.25, 1.0, 4.0])
    row_spread = rng.choice([0.0, 0.0, 20.0])
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    rows_base = base + row_spread * (torch.rand(16, 1, generator=gen) * 2 - 1)
    scores = rows_base + noise * torch.randn(16, keys, generator=gen)
    visit = list(range(n_blocks - 1, -1, -1))  # key blocks, in the kernel's order
    limit = torch.full((16,), keys)  # row r sees keys < limit[r]
    labels = [f"base {base:.0f} noise {noise}"]
    if masks and rng.random() < 0.35:
        n_masked = rng.randint(1, n_blocks)
        lo = (n_blocks - n_masked) * block_n  # the masked blocks' first key
        for r in range(16):
            limit[r] = rng.choice([keys, rng.randint(lo, keys), lo, lo, 0 if lo == 0 else lo])
        if rng.random() < 0.3:
            limit[rng.randrange(16)] = 0  # a row that sees no key at all
        labels.append(f"{n_masked} masked blocks")
    seen = torch.full((16,), -math.inf)
    events = rng.randint(0, 4)
    jumps = {}
    for _ in range(events):
        where = rng.choice(["first", "second", "middle", "last", "any"])
        v = {"first": 0, "second": min(1, n_blocks - 1), "middle": n_blocks // 2,
             "last": n_blocks - 1, "any": rng.randrange(n_blocks)}[where]  # fmt: skip
        jumps.setdefault(v, []).append(
            (_rows(rng), _jump_keys(rng, block_n), jump_size(rng, block_n))
        )
    key = torch.arange(keys)
    masked = key[None, :] >= limit[:, None]
    for v, b in enumerate(visit):
        cols = slice(b * block_n, (b + 1) * block_n)
        block = scores[:, cols].clone()
        block[masked[:, cols]] = -math.inf
        for rows, jump_keys, size in jumps.get(v, []):
            for r in rows:
                top = seen[r].item() if seen[r] > -math.inf else rows_base[r].item()
                for j in jump_keys:
                    if not masked[r, b * block_n + j]:
                        block[r, j] = top + size
            labels.append(f"jump {size:.4g} in visit {v}")
        block = exact16(block)
        scores[:, cols] = block
        seen = torch.maximum(seen, block.amax(dim=1))
    return exact16(scores), "; ".join(labels)


def random_case(rng: random.Random, block_n: int, n_blocks: int, warps: int, masks: bool = True):
    """``warps`` warps' scores (warps, 16, keys) and their labels."""
    made = [random_warp(rng, block_n, n_blocks, masks) for _ in range(warps)]
    return torch.stack([s for s, _ in made]), [label for _, label in made]


def edge_case(block_n: int, n_blocks: int, edge: float, offset: float, visit: int, rows=(5,)):
    """One warp whose every score is -round(edge), so that each row's reference is exactly
    that after its first block, but ``rows``' key 3 of the ``visit``-th visited block:
    edge + offset above it (near 0, where bf16 resolves the offset)."""
    base = -float(round(edge))
    scores = torch.full((1, 16, n_blocks * block_n), base)
    b = n_blocks - 1 - visit
    for r in rows:
        scores[0, r, b * block_n + 3] = base + edge + offset
    return exact16(scores)
