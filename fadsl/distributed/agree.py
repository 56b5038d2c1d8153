"""Every rank of a group agrees on a call before any rank sends: a rank whose arguments are
wrong, or whose call differs from the others' (shapes, dtype, mask, scale, cu_seqlens), ends
in an error on every rank instead of a hang in the ring's first send/recv.

One all_gather of a few int64 per rank (on the group's device: CUDA for NCCL, the CPU for
gloo) and its read on the host; only on an error a second all_gather carries the messages. On two H200s an agreement costs about what one small NCCL collective
and a host sync cost (tens of microseconds), small beside a long sequence's step.
"""

from __future__ import annotations

import struct
import zlib
from typing import Callable

import torch
import torch.distributed as dist

# A call's signature: a fixed number of int64 (shorter ones padded), so that one all_gather
# carries every rank's, with the rank's verdict first (0: its checks passed).
SIGNATURE_INTS = 12


def signature_of(*values) -> tuple[int, ...]:
    """Ints standing for ``values`` (ints, bools, floats by their bits, strings and longer
    tuples by a CRC-32), what ranks of one call must share."""
    out = []
    for value in values:
        if isinstance(value, bool) or isinstance(value, int):
            out.append(int(value))
        elif isinstance(value, float):
            out.append(struct.unpack("<q", struct.pack("<d", value))[0])
        else:
            out.append(zlib.crc32(repr(value).encode()))
    if len(out) > SIGNATURE_INTS - 1:
        raise ValueError(f"a signature of {len(out)} values; at most {SIGNATURE_INTS - 1}")
    return tuple(out)


def agreed(group, rank: int, world: int, check: Callable[[], tuple[int, ...]]) -> None:
    """Run this rank's ``check`` (raising ValueError or TypeError on bad arguments, returning
    the call's signature_of), then make every rank agree: if any rank's check failed, every
    rank raises (its own error where it failed, else one naming the ranks that did, with
    their messages); if the signatures differ, every rank raises a ValueError that names
    them. Returns on every rank or on none."""
    error: Exception | None = None
    signature: tuple[int, ...] = ()
    try:
        signature = check()
    except (ValueError, TypeError) as err:
        error = err
    said = b"" if error is None else f"{type(error).__name__}:{error}".encode()
    row = [len(said), *signature]  # the verdict: 0, or the length of the rank's message
    row += [0] * (SIGNATURE_INTS - len(row))
    device = _device(group)
    table = _gathered(torch.tensor(row, dtype=torch.int64, device=device), group, world)
    longest = max(r[0] for r in table)
    if longest:
        # the messages, as bytes padded to the longest (no pickling: all_gather_object
        # needs NumPy, which torch does not require)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: len(said)] = torch.tensor(list(said), dtype=torch.uint8)
        texts = _gathered(padded, group, world)
        if error is not None:
            raise error
        failed = [
            (r, bytes(texts[r][: table[r][0]]).decode().split(":", 1))
            for r in range(world)
            if table[r][0]
        ]
        kinds = {kind for _, (kind, _) in failed}
        message = "; ".join(f"rank {r}: {text}" for r, (_, text) in failed)
        raise (TypeError if kinds == {"TypeError"} else ValueError)(
            f"another rank's arguments were refused, so no rank runs the call ({message})"
        )
    if any(r != table[rank] for r in table):
        differ = [r for r in range(world) if table[r] != table[0]]
        raise ValueError(
            "the ranks' calls differ (shapes, dtype, mask, scale, head_chunks or cu_seqlens "
            f"must be the same on every rank): ranks {differ} differ from rank 0"
        )


def _gathered(mine: torch.Tensor, group, world: int) -> list[list[int]]:
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def _device(group) -> torch.device:
    """Where the group's collectives take their tensors: the current CUDA device for NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
