"""Document ids for examples/modifiers/document_causal.fa (its `q_doc` and `kv_doc` inputs),
shared by its GPU tests and scripts/sanitize_modifiers.py: one pattern per batch, so that a
call covers what the predicate can meet.

- ``packed``: documents of random lengths laid end to end over the keys, the queries the
  last seqlen_q of them (bottom-right, as the causal mask aligns them); queries before the
  first key (seqlen_q > seqlen_k) take id -1, which no key has.
- ``single``: one document: the plain causal result.
- ``scattered``: ids 0-2 drawn per token for queries and keys alike, unsorted (the kernel
  reads ids, not ranges): rows whose causal keys all differ see none.
- ``foreign``: no query's id is a key's: every row sees no key (output 0, LSE -inf, no
  gradient)."""

from __future__ import annotations

import torch

PATTERNS = ("packed", "single", "scattered", "foreign")


def document_row(pattern: str, sq: int, sk: int, gen: torch.Generator):
    """(q_doc, kv_doc) of one batch row: int32 tensors of sq and sk ids on the CPU."""
    if pattern == "packed":
        lengths = torch.randint(1, max(sk // 3, 1) + 1, (sk,), generator=gen)
        kv = torch.repeat_interleave(torch.arange(sk), lengths)[:sk]
        rows = torch.arange(sq) + (sk - sq)
        q = torch.where(rows >= 0, kv[rows.clamp(0, sk - 1)], torch.full_like(rows, -1))
    elif pattern == "single":
        q, kv = torch.zeros(sq, dtype=torch.long), torch.zeros(sk, dtype=torch.long)
    elif pattern == "scattered":
        q = torch.randint(0, 3, (sq,), generator=gen)
        kv = torch.randint(0, 3, (sk,), generator=gen)
    elif pattern == "foreign":
        q, kv = torch.full((sq,), 7), torch.randint(0, 3, (sk,), generator=gen)
    else:
        raise ValueError(pattern)
    return q.to(torch.int32), kv.to(torch.int32)


def document_ids(patterns, sq: int, sk: int, seed: int, device: str = "cuda"):
    """The call's inputs, {"q_doc": (batch, sq), "kv_doc": (batch, sk)}, one pattern a row."""
    gen = torch.Generator().manual_seed(seed)
    rows = [document_row(p, sq, sk, gen) for p in patterns]
    return {
        "q_doc": torch.stack([r[0] for r in rows]).to(device),
        "kv_doc": torch.stack([r[1] for r in rows]).to(device),
    }


def document_keep(made) -> torch.Tensor:
    """The predicate in torch, (batch, 1, sq, sk): q_doc[b, i] == kv_doc[b, j]."""
    return (made["q_doc"][:, :, None] == made["kv_doc"][:, None, :])[:, None]


def recorded_workspaces(monkeypatch) -> list:
    """Each pair of class workspaces a call makes (fadsl/targets/sm90/host/keep_classes.py's
    workspaces: the forward's, then the backward's), as (its tiles' B_r, (class bytes, the
    forward's lists of kept blocks or the backward's ranges)), in the order made."""
    from fadsl.targets.sm90.host import keep_classes

    made = []
    real = keep_classes.workspaces

    def recording(*args, **kwargs):
        found = real(*args, **kwargs)
        made.append((args[3], found[0]))
        return found

    monkeypatch.setattr(keep_classes, "workspaces", recording)
    return made
