"""The attention a context-parallel call runs on each rank and ring step: a forward that
returns the LSE, and a backward that takes the whole call's output and LSE (so that each
step's gradients are exact parts of the whole's: P = exp(S - LSE), D = rowsum(dO O)).

- ``ShippedStep``: fadsl.attention's kernels (the shipped spec for q's head_dim and mask,
  through the ``fadsl::attention`` and ``fadsl::attention_backward`` ops);
- ``SpecStep``: two loaded specs with backward blocks, one causal and one without a mask
  (any head_dim, dtype and tile a spec gives);
- ``ReferenceStep``: the same maths in fp32 torch, on any device (tests, and a check).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from ..runtime import public_ops  # the fadsl::attention ops, registered on import


class AttentionStep(Protocol):
    def forward(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out in q's dtype, lse fp32 (batch, heads_q, seqlen_q))."""

    def backward(self, q, k, v, out, lse, dout, causal: bool, scale: float):
        """(dq, dk, dv) of this step's keys, given the whole call's out and lse."""

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
        """Packed sequences (tokens, heads, head_dim): (out, lse fp32 (heads_q, tokens_q))."""

    def backward_varlen(self, q, k, v, out, lse, dout, cu_q, cu_k, max_q, causal, scale):
        """(dq, dk, dv) of packed sequences, given the whole call's out and lse."""


class ShippedStep:
    def forward(self, q, k, v, causal, scale):
        return public_ops.attention(q, k, v, causal, scale, -1, -1, 0.0, True)

    def backward(self, q, k, v, out, lse, dout, causal, scale):
        return public_ops.attention_backward(
            q, k, v, out, lse, dout, None, causal, scale, -1, -1, 0.0
        )

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return public_ops.attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, -1, -1, 0.0, True
        )

    def backward_varlen(self, q, k, v, out, lse, dout, cu_q, cu_k, max_q, causal, scale):
        return public_ops.attention_varlen_backward(
            q, k, v, out, lse, dout, None, cu_q, cu_k, max_q, causal, scale, -1, -1, 0.0
        )


class SpecStep:
    """Two loaded specs (``fadsl.load``) with backward blocks: ``causal`` (mask causal) and
    ``full`` (no mask), of the same head_dim."""

    def __init__(self, causal, full):
        for name, kern in (("causal", causal), ("full", full)):
            if not getattr(kern, "has_backward", False):
                raise ValueError(f"SpecStep: {name} must be a loaded spec with a backward block")
        if causal.config.mask.value != "causal" or full.config.mask.value != "none":
            raise ValueError("SpecStep: causal needs `mask causal`, full no mask")
        self.kernels = {True: causal, False: full}

    def forward(self, q, k, v, causal, scale):
        return self.kernels[causal](q, k, v, softmax_scale=scale, return_lse=True)

    def backward(self, q, k, v, out, lse, dout, causal, scale):
        return self.kernels[causal].backward(q, k, v, out, lse, dout, None, scale)

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        kern = self.kernels[causal]
        return kern.varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, return_lse=True)

    def backward_varlen(self, q, k, v, out, lse, dout, cu_q, cu_k, max_q, causal, scale):
        kern = self.kernels[causal]
        return kern.varlen_backward(q, k, v, out, lse, dout, None, cu_q, cu_k, scale)


def _scores(q, k, scale, causal: bool):
    """fp32 scores (batch, heads_q, seqlen_q, seqlen_k), K's heads repeated over GQA groups,
    -inf past the causal diagonal (bottom-right aligned, as fadsl's and FlashAttention's)."""
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if causal:
        i = torch.arange(q.shape[1], device=q.device)[:, None]
        j = torch.arange(k.shape[1], device=q.device)[None, :]
        s = s.masked_fill(j > i + (k.shape[1] - q.shape[1]), float("-inf"))
    return s


class ReferenceStep:
    def forward(self, q, k, v, causal, scale):
        s = _scores(q, k, scale, causal)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(lse > float("-inf"), lse, 0.0)[..., None])
        group = q.shape[2] // k.shape[2]
        vf = v.float().repeat_interleave(group, dim=2)
        out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
        return out.to(q.dtype), lse

    def backward(self, q, k, v, out, lse, dout, causal, scale):
        s = _scores(q, k, scale, causal)
        p = torch.exp(s - torch.where(lse > float("-inf"), lse, math.inf)[..., None])
        group = q.shape[2] // k.shape[2]
        kf = k.float().repeat_interleave(group, dim=2)
        vf = v.float().repeat_interleave(group, dim=2)
        do = dout.float()
        dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
        dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
        d = (do * out.float()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
        ds = p * (dp - d[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.float()) * scale

        def per_kv_head(g):  # GQA: a K/V head's gradient sums its group's
            b, n, h, d_ = g.shape
            return g.view(b, n, h // group, group, d_).sum(3)

        return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)

    def forward_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        """Sequence by sequence through ``forward``."""
        outs, lses = [], []
        for (a, b), (c, d) in zip(_spans(cu_q), _spans(cu_k)):
            o, l = self.forward(q[None, a:b], k[None, c:d], v[None, c:d], causal, scale)
            outs.append(o[0])
            lses.append(l[0])
        return torch.cat(outs, 0), torch.cat(lses, 1)

    def backward_varlen(self, q, k, v, out, lse, dout, cu_q, cu_k, max_q, causal, scale):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (a, b), (c, d) in zip(_spans(cu_q), _spans(cu_k)):
            g = self.backward(
                q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b], lse[None, :, a:b],
                dout[None, a:b], causal, scale,
            )  # fmt: skip
            dq[a:b], dk[c:d], dv[c:d] = g[0][0], g[1][0], g[2][0]
        return dq, dk, dv


def _spans(cu) -> list[tuple[int, int]]:
    cu = cu.tolist()
    return list(zip(cu, cu[1:]))
