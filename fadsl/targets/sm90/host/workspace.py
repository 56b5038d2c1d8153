"""The global-memory workspace of ``tail split_kv`` launches (fadsl/targets/sm90/host/launch.py, split_tail).

A split tile's pieces hand their partial O, m and l over through ``partials`` (fp32; no
initial value needed: each piece writes its own before any piece reads it) and count
themselves done on ``counts`` (uint32, one per split tile and consumer warpgroup), which
the kernel's atom.inc wraps back to 0 at each tile's last piece: a launch that completes
leaves every counter at 0, ready for the next one.

One workspace per device and stream, grown as needed: launches on one stream run in turn,
so they may share it; launches on two streams may overlap, so they may not. A CUDA graph
capture gets buffers of its own (the zeroing memset is captured with it and replays with
it), which are kept for the life of the process (the graph may outlive any reference the
caller holds; captures are few).
"""

from __future__ import annotations

from typing import Any

_WORKSPACES: dict[tuple[int, int], tuple[Any, Any]] = {}
_CAPTURED: list[tuple[Any, Any]] = []


def split_workspace(device: Any, floats: int, counters: int) -> tuple[int, int]:
    """Pointers to at least ``floats`` fp32 partials and ``counters`` zeroed uint32 counters
    for a launch on ``device``'s current stream."""
    import torch

    from ...launch import current_stream

    index = device.index
    if index == torch.cuda.current_device():
        capturing = torch.cuda.is_current_stream_capturing()
    else:  # the launch's stream is q's device's
        with torch.cuda.device(index):
            capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        buffers = _allocate(device, floats, counters)
        _CAPTURED.append(buffers)
    else:
        key = (index, current_stream(index))
        buffers = _WORKSPACES.get(key)
        if buffers is None or buffers[0].numel() < floats or buffers[1].numel() < counters:
            old = (0, 0) if buffers is None else (buffers[0].numel(), buffers[1].numel())
            # Freed buffers go back to PyTorch's allocator in stream order: a launch still
            # running on this stream keeps its bytes until it is done.
            buffers = _allocate(device, max(floats, old[0]), max(counters, old[1]))
            _WORKSPACES[key] = buffers
    return buffers[0].data_ptr(), buffers[1].data_ptr()


def _allocate(device: Any, floats: int, counters: int) -> tuple[Any, Any]:
    import torch

    partials = torch.empty(floats, dtype=torch.float32, device=device)
    counts = torch.zeros(counters, dtype=torch.int32, device=device)
    return partials, counts
