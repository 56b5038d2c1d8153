"""insert_barriers: order every SMEM hazard with the cheapest sync that covers it.

The pass is generic over the target's sync model: it asks the model for the
cheapest barrier that covers a scope and for the wait that completes an async
write kind, and reads each placed sync by its fields (the scope a barrier meets,
the writes a wait completes and by which rule). On sm_80 that is:

The pass walks the schedule as it runs -- prologue, two mainloop iterations
(the second one exposes hazards across the back edge), epilogue -- keeping a
history of the SMEM accesses made so far and, for each, whether a sync has
already ordered it against later accesses of the same warp or of every warp.
When a step conflicts with an access that nothing orders yet, a sync goes
immediately before that step (as late as the consumer allows):
``__syncwarp()`` when only one warp's lanes conflict, ``__syncthreads()``
when warps cross; a ``cp.async.wait_group N`` first when the earlier access is
an asynchronous write, with N the groups committed since (they stay in
flight). A hazard from the prologue into the first iteration is ordered at the
end of the prologue instead, so that it is not paid on every iteration. A sync
separated from an earlier one only by cp.async issues joins that one instead
(one barrier instead of two, for waiting a few issue cycles earlier). The
walk restarts after each insertion until nothing is missing; then every sync
that can be dropped without reopening a hazard is dropped, and every other one
is weakened as far as it can be (a warp barrier for a CTA barrier, a wait that
leaves more groups in flight); finally a last walk records which hazards each
remaining sync serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from .target import PassTarget
from ..ir import (
    Access,
    Buffer,
    Hazard,
    HazardKind,
    Item,
    Kernel,
    Mode,
    Partition,
    Phase,
    Scope,
    Step,
    Sync,
)
from ..ir.syncmodel import AsyncKind, SyncModel, WaitRule, covers

# A static position: (phase, index of the item in that phase's tuple).
Pos = tuple[Phase, int]


@dataclass
class _Past:
    """One access made earlier in the walk."""

    access: Access
    step: Step
    iteration: int  # -1 outside the loop, else 0 or 1
    group: int | None  # the commit group of an async write (counted per async kind)
    waited_by: int | None = None  # id of the wait that completed it
    warp_ordered: list[int] = field(default_factory=list)  # ids of syncs that order it per warp
    cta_ordered: list[int] = field(default_factory=list)  # ids of syncs that order it CTA-wide


@dataclass(frozen=True)
class _Need:
    """What the walk found missing before ``pos``."""

    pos: Pos
    scope: Scope
    wait_groups: int | None  # a wait for ``async_kind`` first, leaving this many in flight
    async_kind: AsyncKind | None = None


def _bytes(buf: Buffer, part: Partition, warp: int, warps: int) -> tuple[int, int]:
    assert buf.offset is not None, "plan_smem must run before insert_barriers"
    if part is Partition.WHOLE:
        return buf.offset, buf.offset + buf.nbytes
    size = buf.nbytes // warps
    return buf.offset + warp * size, buf.offset + (warp + 1) * size


def conflict_scope(kernel: Kernel, a: Access, b: Access) -> Scope | None:
    """CTA if two different warps touch common bytes, WARP if only a warp with itself."""
    if a.mode is Mode.READ and b.mode is Mode.READ:
        return None
    warps = kernel.config.warps
    ba, bb = kernel.buffer(a.buffer), kernel.buffer(b.buffer)
    scope = None
    for wa in range(warps):
        lo_a, hi_a = _bytes(ba, a.partition, wa, warps)
        for wb in range(warps):
            lo_b, hi_b = _bytes(bb, b.partition, wb, warps)
            if lo_a < hi_b and lo_b < hi_a:
                if wa != wb:
                    return Scope.CTA
                scope = Scope.WARP
    return scope


def _kind(earlier: Access, later: Access) -> HazardKind:
    if earlier.mode is Mode.WRITE:
        return HazardKind.WAW if later.mode is Mode.WRITE else HazardKind.RAW
    return HazardKind.WAR


def _trace(kernel: Kernel, iterations: int) -> Iterator[tuple[Pos, Item, int]]:
    """Static positions in execution order: prologue, the iterations, epilogue."""
    for i, item in enumerate(kernel.prologue):
        yield (Phase.PROLOGUE, i), item, -1
    for it in range(iterations):
        for i, item in enumerate(kernel.mainloop):
            yield (Phase.MAINLOOP, i), item, it
    for i, item in enumerate(kernel.epilogue):
        yield (Phase.EPILOGUE, i), item, -1


def _walk(kernel: Kernel) -> tuple[_Need | None, dict[int, list[Hazard]]]:
    """Run the schedule with two iterations (the second exposes the back edge) and, when
    the loop may be empty, with none; return the first missing sync and what each sync serves."""
    served: dict[int, list[Hazard]] = {}
    # One iteration too: a wait count that counts groups of a second iteration is too lax
    # when the loop runs once.
    for iterations in (1, 2, 0) if kernel.loop_may_be_empty else (1, 2):
        need, more = _walk_trace(kernel, iterations)
        if need is not None:
            return need, served
        for sid, hazards in more.items():
            served.setdefault(sid, []).extend(hazards)
    return None, served


def _completes(wait: Sync, past: _Past, committed: int) -> bool:
    """Whether ``wait``, placed after ``committed`` groups of its kind, completes ``past``."""
    kind = wait.kind
    if past.group is None or past.step.async_kind != kind.completes:
        return False
    match kind.rule:
        case WaitRule.NEWEST_PENDING:
            return past.group < committed - wait.groups
        case _:
            raise AssertionError(f"insert_barriers: no rule for {kind.name}")


def _walk_trace(kernel: Kernel, iterations: int) -> tuple[_Need | None, dict[int, list[Hazard]]]:
    history: list[_Past] = []
    groups: dict[AsyncKind, int] = {}  # groups committed so far, per async kind
    prologue_groups: dict[AsyncKind, int] = {}
    for item in kernel.prologue:
        if isinstance(item, Step) and item.async_kind is not None:
            prologue_groups[item.async_kind] = prologue_groups.get(item.async_kind, 0) + 1
    served: dict[int, list[Hazard]] = {}
    sync_ids = {id(s): n for n, s in enumerate(kernel.syncs())}
    for pos, item, iteration in _trace(kernel, iterations):
        if isinstance(item, Sync):
            sid = sync_ids[id(item)]
            for past in history:
                if item.kind.completes is not None:
                    committed = groups.get(item.kind.completes, 0)
                    if _completes(item, past, committed) and past.waited_by is None:
                        past.waited_by = sid
                    continue
                if past.group is not None and past.waited_by is None:
                    continue  # still in flight: a barrier does not order it
                assert item.kind.scope is not None
                if covers(item.kind.scope, Scope.CTA):
                    past.cta_ordered.append(sid)
                past.warp_ordered.append(sid)
            continue
        need_scope: Scope | None = None
        need_group: int | None = None  # the newest async group that must have landed
        need_kind: AsyncKind | None = None
        from_loop = False  # some unordered earlier access was made inside the mainloop
        for acc in item.accesses:
            for n, past in enumerate(history):
                scope = conflict_scope(kernel, past.access, acc)
                if scope is None:
                    continue
                by = past.cta_ordered if scope is Scope.CTA else past.warp_ordered
                hazard = Hazard(
                    kind=_kind(past.access, acc),
                    earlier=past.step.op,
                    later=item.op,
                    earlier_buffer=past.access.buffer,
                    later_buffer=acc.buffer,
                    scope=scope,
                    back_edge=past.iteration == 0 and iteration == 1,
                    async_write=past.group is not None,
                )
                if by:
                    if not _shadowed(kernel, history[n + 1 :], past.access, acc):
                        served.setdefault(by[0], []).append(hazard)
                        if past.waited_by is not None:
                            served.setdefault(past.waited_by, []).append(hazard)
                    continue
                need_scope = Scope.CTA if scope is Scope.CTA else (need_scope or Scope.WARP)
                from_loop = from_loop or past.iteration != -1
                if past.group is not None and past.waited_by is None:
                    kind = past.step.async_kind
                    if need_kind not in (None, kind):
                        raise AssertionError("insert_barriers: one sync waits for one async kind")
                    need_kind = kind
                    need_group = max(past.group, need_group if need_group is not None else -1)
        if need_scope is not None:
            count = groups  # groups issued before the sync goes in
            if pos[0] is Phase.MAINLOOP and iteration == 0 and not from_loop:
                pos = (Phase.PROLOGUE, len(kernel.prologue))
                count = prologue_groups
            # wait N lets the N newest groups stay in flight.
            wait = None
            if need_group is not None:
                wait = count.get(need_kind, 0) - need_group - 1
            return _Need(pos, need_scope, wait, need_kind), served
        kind = item.async_kind
        for acc in item.accesses:
            group = groups.get(kind, 0) if kind is not None else None
            history.append(_Past(acc, item, iteration, group))
        if kind is not None:
            groups[kind] = groups.get(kind, 0) + 1
    return None, served


def _span(kernel: Kernel, access: Access) -> tuple[int, int]:
    buf = kernel.buffer(access.buffer)
    assert buf.offset is not None
    return buf.offset, buf.offset + buf.nbytes


def _shadowed(kernel: Kernel, between: list[_Past], earlier: Access, later: Access) -> bool:
    """A hazard is reported only where it is direct: no access in between touches the
    bytes both sides share (the chain through that access implies it)."""
    lo = max(_span(kernel, earlier)[0], _span(kernel, later)[0])
    hi = min(_span(kernel, earlier)[1], _span(kernel, later)[1])
    for past in between:
        m_lo, m_hi = _span(kernel, past.access)
        if m_lo < hi and lo < m_hi:
            return True
    return False


def _items(kernel: Kernel, phase: Phase) -> list[Item]:
    return list(dict(kernel.phases())[phase])


def _with_items(kernel: Kernel, phase: Phase, items: list[Item]) -> Kernel:
    field_name = {
        Phase.PROLOGUE: "prologue",
        Phase.MAINLOOP: "mainloop",
        Phase.EPILOGUE: "epilogue",
    }
    return replace(kernel, **{field_name[phase]: tuple(items)})


def _join_earlier(kernel: Kernel, items: list[Item], need: _Need) -> _Need:
    """Move a need back to an earlier run of syncs when only cp.async issues stand between.

    Issuing an async copy takes a few cycles; a barrier makes every warp wait for the slowest.
    So a sync that would follow another with nothing but issues between them joins it,
    provided none of those issues is a side of a hazard that the sync orders (it would then
    come before its own earlier side). Its wait keeps the groups it completes: each skipped
    issue is one group fewer committed at the earlier position.
    """
    phase, index = need.pos
    start = index
    while start > 0 and isinstance(items[start - 1], Sync):
        start -= 1
    if index >= len(items) or not isinstance(items[index], Step):
        return need
    later = items[index]
    j = start
    skipped = 0  # issues of the awaited kind between the two positions
    while j > 0 and isinstance(items[j - 1], Step) and items[j - 1].is_async:
        issue = items[j - 1]
        if any(conflict_scope(kernel, a, b) for a in issue.accesses for b in later.accesses):
            return need
        skipped += issue.async_kind == need.async_kind
        j -= 1
    if j == start or j == 0 or not isinstance(items[j - 1], Sync):
        return need
    wait = None if need.wait_groups is None else need.wait_groups - skipped
    return _Need((phase, j), need.scope, wait, need.async_kind)


def _insert(kernel: Kernel, need: _Need, model: SyncModel) -> Kernel:
    """Add (or strengthen) the wait and barrier right before ``need.pos``."""
    need = _join_earlier(kernel, _items(kernel, need.pos[0]), need)
    phase, index = need.pos
    items = _items(kernel, phase)
    loc = items[index].loc if index < len(items) else kernel.config.loc
    # The run of syncs immediately before the position.
    start = index
    while start > 0 and isinstance(items[start - 1], Sync):
        start -= 1
    run = items[start:index]
    if need.wait_groups is not None:
        assert need.async_kind is not None
        wait_kind = model.wait_for(need.async_kind)
        waits = [s for s in run if s.kind == wait_kind]
        if waits:
            i = items.index(waits[0], start)
            items[i] = replace(waits[0], groups=min(waits[0].groups, need.wait_groups))
        else:
            items.insert(start, Sync(wait_kind, phase, (), loc, need.wait_groups))
            index += 1
        run = items[start:index]
    kind = model.barrier_for(need.scope)
    barriers = [s for s in run if s.kind.scope is not None]
    if barriers:
        i = items.index(barriers[0], start)
        if not covers(barriers[0].kind.scope, need.scope):
            items[i] = replace(barriers[0], kind=kind)
    else:
        items.insert(index, Sync(kind, phase, (), loc))
    return _with_items(kernel, phase, items)


def _without(kernel: Kernel, phase: Phase, index: int) -> Kernel:
    items = _items(kernel, phase)
    del items[index]
    return _with_items(kernel, phase, items)


def insert_barriers(kernel: Kernel, target: PassTarget) -> Kernel:
    """Place the syncs the kernel's target's sync model offers."""
    model = target.sync_model
    # Start from a schedule without syncs: the pass owns them.
    for phase, _ in kernel.phases():
        kernel = _with_items(
            kernel, phase, [i for i in _items(kernel, phase) if isinstance(i, Step)]
        )
    while True:
        need, _ = _walk(kernel)
        if need is None:
            break
        placed = _insert(kernel, need, model)
        if placed == kernel:
            raise AssertionError(f"insert_barriers: no progress placing {need}")
        kernel = placed
    # Drop each sync that the plan does not need (last placed first), and weaken each one
    # that stays as far as the plan allows: a sync placed for one hazard may end up serving
    # only hazards that need less (the others covered by a sync placed later).
    most = sum(1 for s in kernel.steps() if s.is_async)
    for phase, items in reversed(kernel.phases()):
        for index in reversed(range(len(items))):
            if not isinstance(items[index], Sync):
                continue
            candidate = _without(kernel, phase, index)
            if _walk(candidate)[0] is None:
                kernel = candidate
                continue
            weaker = _weaker(items[index], most, model)
            while weaker is not None:
                current = _items(kernel, phase)
                current[index] = weaker
                candidate = _with_items(kernel, phase, current)
                if _walk(candidate)[0] is not None:
                    break
                kernel, weaker = candidate, _weaker(weaker, most, model)
    # Record, on each sync, the hazards it serves.
    _, served = _walk(kernel)
    syncs = kernel.syncs()
    annotated = {id(s): replace(s, serves=_unique(served.get(n, []))) for n, s in enumerate(syncs)}
    for phase, items in kernel.phases():
        kernel = _with_items(
            kernel, phase, [annotated.get(id(i), i) if isinstance(i, Sync) else i for i in items]
        )
    return kernel


def _weaker(sync: Sync, most_groups: int, model: SyncModel) -> Sync | None:
    """The next weaker sync in the same place: the next cheaper barrier (a warp barrier
    for a CTA barrier); a counted wait that lets one more group stay in flight."""
    if sync.kind.scope is not None:
        weaker = model.weaker_barrier(sync.kind)
        return None if weaker is None else replace(sync, kind=weaker)
    if sync.kind.counted and sync.groups < most_groups:
        return replace(sync, groups=sync.groups + 1)
    return None


def _unique(hazards: list[Hazard]) -> tuple[Hazard, ...]:
    seen: dict[Hazard, None] = {}
    for h in hazards:
        seen.setdefault(h, None)
    return tuple(seen)
