"""Train a small transformer block with context parallelism: each rank holds a zigzag shard of
every sequence, attention runs as a ring over the ranks (fadsl.distributed.ring_attention,
fadsl's kernels in every step), everything else is per token. Parameters are replicated: their
gradients are summed over the ranks after each backward (what DDP would do).

    torchrun --nproc-per-node 2 examples/context_parallel_train.py [--seqlen 16384] [--steps 20]

Prints the loss per step on rank 0 and, with --check, the first step's loss and gradients
beside the same block run on one GPU over the whole sequence (fadsl.attention).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fadsl
import fadsl.distributed as fcp


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim, bias=False),
            torch.nn.GELU(),
            torch.nn.Linear(4 * dim, dim, bias=False),
        )

    def forward(self, x, attention):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [
                self.heads * self.head_dim,
                self.kv_heads * self.head_dim,
                self.kv_heads * self.head_dim,
            ],
            dim=-1,
        )
        q = q.view(b, n, self.heads, self.head_dim)
        k, v = (t.reshape(b, n, self.kv_heads, self.head_dim) for t in (k, v))
        x = x + self.proj(attention(q, k, v).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(0)  # the same parameters and data on every rank
    block = Block(args.dim, args.heads, args.kv_heads).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
    x = torch.randn(1, args.seqlen, args.dim, device="cuda", dtype=torch.bfloat16)
    target = torch.randn_like(x)
    x_mine, target_mine = (fcp.shard_zigzag(t, rank, world) for t in (x, target))

    def ring(q, k, v):
        return fcp.ring_attention(q, k, v, causal=True)

    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(block(x_mine, ring).float(), target_mine.float(), reduction="sum")
        loss.backward()
        for p in block.parameters():  # replicated parameters: every rank's tokens count
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if args.check and step == 0:
            _check(block, x, target, total)
        opt.step()
        if rank == 0:
            print(f"step {step:3d}  loss {total.item() / x.numel():.5f}", flush=True)
    dist.destroy_process_group()


def _check(block, x, target, total) -> None:
    """The whole sequence on this GPU: the same loss and gradients within bf16's rounding."""
    ring_grads = [p.grad.float().clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    loss = F.mse_loss(
        block(x, lambda q, k, v: fadsl.attention(q, k, v, causal=True)).float(),
        target.float(),
        reduction="sum",
    )
    loss.backward()
    worst = max(
        ((g - p.grad.float()).norm() / p.grad.float().norm()).item()
        for g, p in zip(ring_grads, block.parameters())
    )
    if dist.get_rank() == 0:
        print(f"check: loss {total.item():.4e} (ring) vs {loss.item():.4e} (one GPU); "
              f"worst relative gradient difference {worst:.2e}")  # fmt: skip
    for g, p in zip(ring_grads, block.parameters()):
        p.grad = g.to(p.dtype)


if __name__ == "__main__":
    main()
