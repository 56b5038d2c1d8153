"""verify's producer agents for a kernel with the transpose hop (8-bit dtypes; research/
fp8-forward.md §3.3).

Without a transpose the producer is one agent, its elected thread. With one, the producer
warpgroup's 4 warps each transpose their own head_dim / 4 rows of every Vt slot, so the
producer becomes 4 agents ``pw0`` .. ``pw3`` of 32 threads: pw0 runs the elected thread's
items (the TMA loads and their barriers) and its own transposes in program order (one
instruction stream: a warp 0 blocked in a ``k_empty`` wait does not transpose, which only
this shows), pw1..pw3 the transposes alone. As verify reads the generated code:

- ``producer_warps`` items run in every warp agent; their arrivals are 32 (every thread);
  ``producer_warp_lane0`` arrivals are one per warp agent;
- a transpose of ring item i reads the whole raw V slot of item i (each warp's ldmatrix
  reads all of its keys) and writes, in each Vt panel, the warp's contiguous rows
  (``vt_warp_spans``): whole swizzle atoms, never another warp's bytes;
- a ``__syncwarp`` is a bar.sync of the warp's agent alone (an id of its own per warp,
  ``warp_barrier``); an arrival by lane 0 stands for its whole warp only after such a
  meeting: every transpose a warp runs is followed by its ``__syncwarp`` before its next
  lane-0 arrival (``lane0_problems``: the async model cannot tell lane 0's arrival from
  the other lanes' reads, as it takes an agent's events in one program order);
- Vt lies in panels of 128 keys a row (the 128-byte swizzle), or 64 keys when B_c is not a
  multiple of 128; tests/fp8_layout_model.py models the instructions and checks that each
  warp's stmatrix addresses fill exactly these spans.
"""

from __future__ import annotations

from typing import Protocol

from ...ir import Kernel, Mode, Step
from ...ir.ops import Op
from ...passes.asyncmodel.model import Arrive, BarSync, Event, GenericAccess, Program, Span


class WarpAgent(Protocol):
    """What this module reads of verify's agent (verify imports this module, not back)."""

    kernel: Kernel
    cta: int
    warp: int | None


PRODUCER_WARPS = 4
WARP_THREADS = 32
# __syncwarp as a barrier id of the model's, above the 16 hardware named barriers
WARP_BARRIER_BASE = 100


def warp_barrier(warp: int | None) -> int:
    assert warp is not None, "__syncwarp outside the producer warps"
    return WARP_BARRIER_BASE + warp


def transposes(kernel: Kernel) -> bool:
    return any(s.op is Op.TRANSPOSE_V for s in kernel.steps())


def producer_roles(kernel: Kernel) -> list[tuple[str, None, int, int | None]]:
    """(name, wg, threads, warp) of the producer's agents."""
    if not transposes(kernel):
        return [("producer", None, 1, None)]
    return [(f"pw{w}", None, WARP_THREADS, w) for w in range(PRODUCER_WARPS)]


def vt_panel_keys(block_c: int) -> int:
    """Keys per row of a Vt panel: 128 (128-byte swizzle), 64 when B_c is not a multiple."""
    return 128 if block_c % 128 == 0 else 64


def vt_warp_spans(head_dim: int, block_c: int, warp: int) -> list[tuple[int, int]]:
    """The byte ranges of a Vt slot (1-byte elements) that producer warp ``warp`` writes:
    its rows [warp d/4, (warp + 1) d/4) of each panel."""
    panel = vt_panel_keys(block_c)
    rows = head_dim // PRODUCER_WARPS
    spans = []
    for p in range(block_c // panel):
        lo = p * head_dim * panel + warp * rows * panel
        spans.append((lo, lo + rows * panel))
    return spans


def transpose_events(agent: WarpAgent, step: Step, slot: int, what: str) -> list[Event]:
    """A warp's transpose of one ring item: its reads of the raw slot, its Vt writes."""
    events: list[Event] = []
    for access in step.accesses:
        buf = agent.kernel.buffer(access.buffer)
        assert buf.offset is not None
        slot_here = slot if buf.slots > 1 else 0  # the ring item's slot, in this buffer's ring
        base = buf.offset + slot_here * buf.tile_bytes
        label = f"{buf.name}[slot {slot_here}]" if buf.slots > 1 else buf.name
        if access.mode is Mode.READ:
            span = Span("smem", base, base + buf.tile_bytes, label, agent.cta)
            events.append(GenericAccess(span, False, what))
            continue
        cfg = agent.kernel.config
        assert buf.elem_bytes == 1, "Vt's spans are those of 1-byte elements"
        for lo, hi in vt_warp_spans(cfg.head_dim, cfg.block_c, agent.warp):
            label_w = f"{label} rows of pw{agent.warp}"
            events.append(
                GenericAccess(Span("smem", base + lo, base + hi, label_w, agent.cta), True, what)
            )
    return events


def lane0_problems(program: Program) -> list[str]:
    """A producer warp's lane-0 arrival after its generic accesses with no __syncwarp of the
    warp between: the other lanes' ldmatrix reads (or stmatrix writes) are not yet done."""
    problems = []
    for agent in program.agents:
        if not agent.name.startswith("pw"):
            continue
        pending = None  # the warp's last generic access not yet followed by its __syncwarp
        for index, event in enumerate(agent.events):
            match event:
                case GenericAccess(what=what):
                    pending = (index, what)
                case BarSync():
                    pending = None
                case Arrive(count=1, tx=0) if pending is not None:
                    problems.append(
                        f"{agent.name} #{index} (lane 0's arrival on {event.barrier}) follows "
                        f"#{pending[0]} ({pending[1]}) with no __syncwarp of {agent.name} "
                        "in between: the warp's other lanes may still access the bytes"
                    )
                    pending = None
    return problems
