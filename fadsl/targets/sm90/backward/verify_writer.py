"""verify.py's rules for the dQ writer warps (`dq_writer on`, research/backward-dq-writer.md),
read from the plan's items as the header runs them; nothing here knows where the sync pass
put them (syncs/writer.py), only what the hardware needs.

In the async model writer w is an agent of 32 threads (``writer{w}``) beside consumer
warpgroup w: its bar.sync / bar.arrive on kBarDqFull + w and kBarDqEmpty + w meet the
consumer's 128 threads (160 in all), its lane-0 items (the bulk reduce-add, its commit and
waits) are the agent's events, which the model takes in the warp's one program order. That
order holds for the other lanes only through a ``__syncwarp`` after lane 0's items (the
FP8 forward's lane-0 rule, targets/sm90/transpose_agents.py): ``lane0_problems`` checks
that every named barrier of the warp (bar.sync, bar.arrive) follows lane 0's items with a
``__syncwarp`` between, in m-block order across the loop's back edge: both are .aligned
(the warp executes them converged, which only the ``__syncwarp`` promises after lane 0's
divergent block), and an arrival that its consumer waits on must follow lane 0's waits.
The model itself lowers ``__syncwarp`` to nothing.

``semaphore_problems`` checks the ordered add's shape in the writer, as verify.py's checks
the consumer's leader: lane 0 acquires the ticket and fences the async proxy before the
add; after it, in the same m-block, its bulk group committed and waited for with
wait_group 0 (the adds performed), a fence, then the release; no wait on anything (a
bar.sync, another acquire) between the add and its release, so that a writer never blocks
while a CTA or writer after it waits for its ticket (the design's deadlock argument: the
consumer waits on its writer only at the empty barrier, for the previous m-block's read;
the writer on its consumer only at the full barrier, after its release). Every ticket is
released before the program ends; no semaphore item in the consumer then.

``exit_problems``: lane 0's reduce-adds are all committed and completed (wait_group 0, not
only .read) before the warp exits, so that the adds are performed before the CTA ends: the
async model sees only their SMEM read. Without ``deterministic`` that is the writer's exit
wait after its loop; with it, each m-block's release has waited so already.
"""

from __future__ import annotations

from .program import Item, Kind, LoopPhase, Named, Protocol, WarpRole, Who, unrolled
from .verify_tickets import Voice, ticket_problems

WRITER_THREADS = 32
_LANE0_KINDS = frozenset(
    {
        Kind.BULK_REDUCE_ADD,
        Kind.BULK_COMMIT,
        Kind.BULK_WAIT_READ,
        Kind.BULK_WAIT,
        Kind.SEM_ACQUIRE,
        Kind.SEM_RELEASE,
        Kind.FENCE_PROXY_ASYNC_GLOBAL,
    }
)
_WARP_KINDS = frozenset({Kind.NAMED_BAR_SYNC, Kind.NAMED_BAR_ARRIVE, Kind.SYNCWARP})
_EXIT_KINDS = frozenset({Kind.BULK_WAIT, Kind.BULK_WAIT_READ})  # lane 0's, after the loop


def agent_name(w: int) -> str:
    return f"writer{w}"


def structural_problems(proto: Protocol) -> list[str]:
    """Who runs what in the writer's program, and whether a writer exists where it must."""
    p, items = proto.params, proto.writer
    if not p.dq_writer:
        return ["a dQ writer program without dq_writer"] if items else []
    problems = []
    if any(x.phase is not LoopPhase.LOOP and x.kind not in _EXIT_KINDS for x in items):
        problems.append("the writer has items outside its m-block loop other than its exit wait")
    phases = [list(LoopPhase).index(x.phase) for x in items]
    if phases != sorted(phases):
        problems.append("the writer's items are not in loop order")
    for n, x in enumerate(items):
        if x.kind in _WARP_KINDS and x.who is not Who.WRITER:
            problems.append(f"writer item {n}: {x.kind.value} by {x.who.value}, not every lane")
        if x.kind in _LANE0_KINDS and x.who is not Who.WRITER_LANE0:
            problems.append(f"writer item {n}: {x.kind.value} by {x.who.value}, not lane 0")
        if x.named not in (None, Named.DQ_FULL, Named.DQ_EMPTY):
            problems.append(f"writer item {n}: {x.named.value} is a consumer's barrier")
    for role in (WarpRole.PRODUCER, WarpRole.CONSUMER):
        for n, x in enumerate(proto.role(role)):
            if x.who in (Who.WRITER, Who.WRITER_LANE0):
                problems.append(f"{role.value} item {n}: {x.kind.value} by {x.who.value}")
    return problems + lane0_problems(items) + exit_problems(items)


def exit_problems(items: tuple[Item, ...]) -> list[str]:
    """Every reduce-add of lane 0 committed and completed (wait_group 0, not only .read)
    before the warp exits, for 1-3 m-blocks: the adds performed before the CTA ends, which
    the async model (SMEM only: a bulk group's read) does not see."""
    for m_count in (1, 2, 3):
        uncommitted, pending = 0, 0  # adds since the last commit; groups not completed
        for x, _ in unrolled(items, m_count):
            if x.who is not Who.WRITER_LANE0:
                continue
            if x.kind is Kind.BULK_REDUCE_ADD:
                uncommitted += 1
            elif x.kind is Kind.BULK_COMMIT:
                pending += uncommitted > 0
                uncommitted = 0
            elif x.kind is Kind.BULK_WAIT:
                pending = min(pending, x.pending)
        left = [f"{pending} bulk group(s) not completed"] if pending else []
        left += [f"{uncommitted} reduce-add(s) not committed"] if uncommitted else []
        if left:
            return [
                f"writer: lane 0 exits after {m_count} m-block(s) with {' and '.join(left)} "
                "(no cp.async.bulk.wait_group without .read after them): the last adds may "
                "not be performed when the CTA ends"
            ]
    return []


def lane0_problems(items: tuple[Item, ...]) -> list[str]:
    """A named barrier of the warp (bar.sync or bar.arrive) after lane 0's items with no
    ``__syncwarp`` between, in the unrolled program (so across the loop's back edge: lane
    0's release at the end of an m-block, the next one's bar.sync). Both are .aligned: the
    warp must execute them converged, and after a lane-0 block only a ``__syncwarp``
    promises that; a bar.arrive that its consumer waits on must also follow lane 0's waits
    in every lane."""
    for m_count in (1, 2, 3):
        problems, pending = [], None
        for x, i in unrolled(items, m_count):
            if x.who is Who.WRITER_LANE0:
                pending = (x, i)
            elif x.kind is Kind.SYNCWARP:
                pending = None
            elif x.kind in (Kind.NAMED_BAR_SYNC, Kind.NAMED_BAR_ARRIVE) and pending is not None:
                lane0, j = pending
                why = "the warp may not run it converged (.aligned)"
                if x.kind is Kind.NAMED_BAR_ARRIVE:
                    why = "the warp's other lanes may arrive before lane 0's waits, and " + why
                problems.append(
                    f"writer: {x.kind.value} {x.named.value} (m-block {i}) follows lane 0's "
                    f"{lane0.name or lane0.kind.value} (m-block {j}) with no __syncwarp in "
                    f"between: {why}"
                )
        if problems:
            return list(dict.fromkeys(problems))
    return []


def semaphore_problems(proto: Protocol) -> list[str]:
    """``deterministic on`` with a writer: the ordered add's shape in the writer's program
    (module docstring), checked for 1-3 m-blocks; none in the consumer."""
    consumer_ops = [x for x in proto.consumer if x.kind in (Kind.SEM_ACQUIRE, Kind.SEM_RELEASE)]
    ops = [x for x in proto.writer if x.kind in (Kind.SEM_ACQUIRE, Kind.SEM_RELEASE)]
    if consumer_ops:
        return ["a dQ semaphore in the consumer with a dQ writer: the writer orders the adds"]
    if not proto.params.deterministic:
        return ["a dQ semaphore without deterministic mode"] if ops else []
    adds = [x for x in proto.writer if x.kind is Kind.BULK_REDUCE_ADD]
    if len(adds) != 1:
        return [f"{len(adds)} dQ reduce-adds per m-block in the writer, expected 1"]
    for m_count in (1, 2, 3):
        problems = ticket_problems(unrolled(proto.writer, m_count), m_count, WRITER_VOICE)
        if problems:
            return problems
    return []


# A writer's lane 0 as verify_tickets.py's agent
WRITER_VOICE = Voice(
    agent=Who.WRITER_LANE0,
    blocks=lambda x: x.kind in (Kind.SEM_ACQUIRE, Kind.NAMED_BAR_SYNC),
    no_acquire="deterministic: the writer's add does not follow the ticket's acquire",
    no_acquire_fence="deterministic: no fence.proxy.async.global between the writer's acquire "
    "and its reduce-add (the async proxy's adds could pass the previous ticket's)",
    no_release="deterministic: the writer releases no ticket after its reduce-add of m-block "
    "{i} (of {m_count}): the CTAs after it wait forever",
    no_completion="deterministic: the writer's release does not follow a committed "
    "cp.async.bulk.wait_group 0 of its reduce-add (its adds may not be performed)",
    no_release_fence="deterministic: no fence.proxy.async.global between the writer's "
    "wait_group 0 and its release",
    blocked="deterministic: the writer releases the ticket of m-block {i} after {what}: a wait "
    "while a CTA after it may wait for its ticket (deadlock)",
)
