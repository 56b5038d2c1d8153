"""Read the printer's text back into the IR, so that a pass test can start from IR by hand.

``format_kernel(read_kernel(text)) == text`` for every text the printer writes.
What the printer leaves out comes back as a default: source locations become the
line of the IR text, step titles are empty, a buffer's swizzle is the kernel's,
a hazard's ``async_write`` is whether its earlier op is an async step, and the
mainloop may be empty when the mask is causal (as the schedule builders set it)
unless the text ends with a ``loop_may_be_empty`` line saying otherwise, and a backward
block comes back without its paths (``fadsl.ir.backward.read_backward``).
Sync kinds and async flags are read through the sync model of the kernel's target.
"""

from __future__ import annotations

import re
from dataclasses import replace

from fadsl import targets
from fadsl.errors import Loc
from fadsl.ir.backward import Backward, read_backward
from fadsl.ir.kernel import (
    Access,
    Buffer,
    Config,
    Hazard,
    Hop,
    Item,
    Kernel,
    Region,
    Step,
    Swizzle,
    Sync,
    Tensor,
    Window,
)
from fadsl.ir.types import (
    AliasPolicy,
    Dtype,
    HazardKind,
    Instr,
    Level,
    Mask,
    Mode,
    Parity,
    Partition,
    Phase,
    RegLoad,
    Role,
    Scope,
    Threads,
)
from fadsl.ir.ops import Op
from fadsl.ir.syncmodel import SyncModel


class IRSyntaxError(ValueError):
    """A line of IR text that does not read; the message names the line."""


_HEADER = re.compile(
    r"kernel (?P<name>\S+) target=(?P<target>\S+) dtypes=(?P<dtypes>\S+) "
    r"head_dim=(?P<head_dim>\d+) B_r=(?P<block_r>\d+) B_c=(?P<block_c>\d+) "
    r"warps=(?P<warps>\d+) mask=(?P<mask>\S+) swizzle=(?P<swizzle>none|xor\(\d+, \d+, \d+\)) "
    r"smem_alias=(?P<alias>\S+)(?P<spills> spills=allow)?"
    r"(?: window=(?P<window_left>\d+),(?P<window_right>\d+))?(?: output=(?P<output>\S+))?$"
)
_BUFFER = re.compile(
    r"buffer (?P<name>\S+) (?P<rows>\d+)x(?P<cols>\d+)x(?P<elem>\d+)B(?: slots=(?P<slots>\d+))? "
    r"scope=(?P<scope>\S+) "
    r"(?:unplanned|offset=(?P<offset>\d+) region=(?P<region>\d+))$"
)
_REGION = re.compile(r"region (\d+) offset=(\d+) bytes=(\d+) members=(\S*)$")
_STEP = re.compile(r"  step (?P<op>\S+)(?P<flags>(?: [^\[\s]\S*)*)(?: \[(?P<acc>.*)\])?$")
_HAZARD = re.compile(
    r"    serves (?P<kind>RAW|WAR|WAW) on (?P<bufs>.+?): (?P<earlier>\S+) -> (?P<later>\S+)"
    r"(?P<edge> across the loop back edge)? \((?P<who>[^()]+)\)$"
)


def read_kernel(text: str, file: str = "<ir>") -> Kernel:
    """The kernel that ``format_kernel`` printed as ``text``."""
    lines = text.rstrip("\n").split("\n")
    reader = _Reader(file)
    return reader.read(lines)


class _Reader:
    def __init__(self, file: str) -> None:
        self.file = file
        self.line = 0

    def loc(self) -> Loc:
        return Loc(self.file, self.line, 1)

    def fail(self, text: str, why: str) -> IRSyntaxError:
        return IRSyntaxError(f"{self.file}:{self.line}: {why}: {text!r}")

    def read(self, lines: list[str]) -> Kernel:
        self.line = 1
        config = self.config(lines[0])
        target = targets.get(config.target)
        if target.read_config is not None and len(lines) > 1:  # the target's settings line
            self.line = 2
            try:
                ext = target.read_config(lines[1])
            except ValueError as err:
                raise self.fail(lines[1], str(err)) from None
            if ext is not None:
                config = replace(config, ext=ext)
                lines = [lines[0], *lines[2:]]
        model = target.sync_model
        tensors: list[Tensor] = []
        buffers: list[Buffer] = []
        regions: list[Region] = []
        smem_bytes: int | None = None
        loop_may_be_empty = config.mask is Mask.CAUSAL
        backward: Backward | None = None
        phases: dict[Phase, list[Item]] = {p: [] for p in Phase}
        phase: Phase | None = None
        pending: list[tuple[int, str]] = []  # hazard lines, read once every step is known
        for self.line, line in enumerate(lines[1:], start=2):
            if line.startswith("tensor "):
                tensors.append(self.tensor(line))
            elif line.startswith("backward ") and backward is None and phase is None:
                try:
                    backward = read_backward(line, self.loc())
                except ValueError as err:
                    raise self.fail(line, str(err)) from None
            elif line.startswith("buffer "):
                buffers.append(self.buffer(line, config.swizzle))
            elif line.startswith("region "):
                regions.append(self.region(line))
            elif line.startswith("  why: ") and regions:
                last = regions[-1]
                regions[-1] = Region(
                    last.index, last.offset, last.nbytes, last.members, (*last.reasons, line[7:])
                )
            elif line.startswith("smem_bytes "):
                smem_bytes = self.number(line[len("smem_bytes ") :])
            elif line in (f"{p.value}:" for p in Phase):
                phase = Phase(line[:-1])
            elif line.startswith("loop_may_be_empty "):
                loop_may_be_empty = line == "loop_may_be_empty true"
            elif phase is not None and line.startswith("  step "):
                phases[phase].append(self.step(line, phase, model))
            elif phase is not None and line.startswith("  sync "):
                phases[phase].append(self.sync(line[len("  sync ") :], phase, model))
            elif phase is not None and line.startswith("    note: ") and phases[phase]:
                last = phases[phase][-1]
                note = line[len("    note: ") :]
                if isinstance(last, _Served):
                    last.sync = replace(last.sync, note=note)
                elif isinstance(last, Sync):
                    phases[phase][-1] = replace(last, note=note)
                else:
                    raise self.fail(line, "a note belongs to the sync above it")
            elif phase is not None and line.startswith("    serves ") and phases[phase]:
                if not isinstance(phases[phase][-1], (Sync, _Served)):
                    raise self.fail(line, "a hazard belongs to the sync above it")
                pending.append((self.line, line))
                phases[phase][-1] = _Served(phases[phase][-1], len(pending) - 1)
            else:
                raise self.fail(line, "not a line of fadsl IR")
        steps = [i for items in phases.values() for i in items if isinstance(i, Step)]
        hazards = []
        for self.line, line in pending:
            hazards.append(self.hazard(line, steps))
        items = {p: tuple(_resolve(i, hazards) for i in phases[p]) for p in Phase}
        return Kernel(
            config=config,
            tensors=tuple(tensors),
            buffers=tuple(buffers),
            prologue=items[Phase.PROLOGUE],
            mainloop=items[Phase.MAINLOOP],
            epilogue=items[Phase.EPILOGUE],
            setup=items[Phase.SETUP],
            teardown=items[Phase.TEARDOWN],
            regions=tuple(regions),
            smem_bytes=smem_bytes,
            loop_may_be_empty=loop_may_be_empty,
            backward=backward,
        )

    def number(self, text: str) -> int:
        if not text.isdigit():
            raise self.fail(text, "expected a number")
        return int(text)

    def enum(self, cls, text: str):
        try:
            return cls(text)
        except ValueError:
            raise self.fail(text, f"unknown {cls.__name__}") from None

    def config(self, line: str) -> Config:
        m = _HEADER.match(line)
        if m is None:
            raise self.fail(line, "expected 'kernel NAME target=... smem_alias=...'")
        if m["target"] not in targets.names():
            raise self.fail(m["target"], "unknown target")
        swizzle = None
        if m["swizzle"] != "none":
            bits, base, shift = (int(n) for n in re.findall(r"\d+", m["swizzle"]))
            swizzle = Swizzle(bits, base, shift, self.loc())
        return Config(
            name=m["name"],
            target=m["target"],
            dtypes=tuple(self.enum(Dtype, d) for d in m["dtypes"].split(",")),
            head_dim=int(m["head_dim"]),
            block_r=int(m["block_r"]),
            block_c=int(m["block_c"]),
            warps=int(m["warps"]),
            mask=self.enum(Mask, m["mask"]),
            swizzle=swizzle,
            smem_alias=self.enum(AliasPolicy, m["alias"]),
            loc=self.loc(),
            allow_spills=m["spills"] is not None,
            window=(
                None
                if m["window_left"] is None
                else Window(int(m["window_left"]), int(m["window_right"]))
            ),
            out_dtype=None if m["output"] is None else self.enum(Dtype, m["output"]),
        )

    def tensor(self, line: str) -> Tensor:
        role_text, _, path = line[len("tensor ") :].partition(": ")
        words = path.split(" ")
        if len(words) % 2 == 0:
            raise self.fail(line, "a path alternates levels and '-instr->' hops")
        levels = [self.level(w) for w in words[::2]]
        hops = []
        for (src, _), (dst, _), word in zip(levels, levels[1:], words[1::2]):
            if not (word.startswith("-") and word.endswith("->")):
                raise self.fail(word, "expected a hop '-instr->'")
            hops.append(Hop(src, dst, self.enum(Instr, word[1:-2]), self.loc()))
        scope = next((b for lv, b in levels if lv is Level.SMEM), None)
        reg_load = next((b for lv, b in levels if lv is Level.RF and b is not None), None)
        if scope is None:
            raise self.fail(line, "a path goes through smem[scope]")
        return Tensor(
            self.enum(Role, role_text),
            tuple(hops),
            self.enum(Scope, scope),
            self.loc(),
            self.enum(RegLoad, reg_load) if reg_load else RegLoad.TILE,
        )

    def level(self, word: str) -> tuple[Level, str | None]:
        m = re.fullmatch(r"(\w+)(?:\[(\w+)\])?", word)
        if m is None:
            raise self.fail(word, "expected a level")
        return self.enum(Level, m[1]), m[2]

    def buffer(self, line: str, swizzle: Swizzle | None) -> Buffer:
        m = _BUFFER.match(line)
        if m is None:
            raise self.fail(line, "expected 'buffer NAME RxCxEB scope=S (unplanned|offset=..)'")
        planned = m["offset"] is not None
        return Buffer(
            name=m["name"],
            rows=int(m["rows"]),
            cols=int(m["cols"]),
            elem_bytes=int(m["elem"]),
            scope=self.enum(Scope, m["scope"]),
            swizzle=swizzle,
            loc=self.loc(),
            offset=int(m["offset"]) if planned else None,
            region=int(m["region"]) if planned else None,
            slots=int(m["slots"]) if m["slots"] else 1,
        )

    def region(self, line: str) -> Region:
        m = _REGION.match(line)
        if m is None:
            raise self.fail(line, "expected 'region I offset=N bytes=N members=A,B'")
        members = tuple(m[4].split(",")) if m[4] else ()
        return Region(int(m[1]), int(m[2]), int(m[3]), members, ())

    def step(self, line: str, phase: Phase, model: SyncModel) -> Step:
        m = _STEP.match(line)
        if m is None:
            raise self.fail(line, "expected 'step OP [flag] [by WHO] [accesses]'")
        flags = m["flags"].split()
        who = Threads.ALL_WARPS
        if len(flags) >= 2 and flags[-2] == "by":
            who = self.enum(Threads, flags[-1])
            flags = flags[:-2]
        lag = None
        if flags and flags[-1].startswith("item=it"):
            lag = self.lag(flags.pop()[len("item=it") :])
        if len(flags) > 1:
            raise self.fail(line, "a step has at most one async flag")
        try:
            async_kind = model.async_kind_flagged(flags[0]) if flags else None
        except KeyError:
            raise self.fail(flags[0], "no async write kind has this flag") from None
        accesses = []
        for text in m["acc"].split(", ") if m["acc"] else ():
            mode, _, rest = text.partition(" ")
            buffer, _, part = rest.partition("/")
            accesses.append(Access(buffer, self.enum(Mode, mode), self.enum(Partition, part)))
        op = self.enum(Op, m["op"])
        return Step(op, phase, tuple(accesses), async_kind, "", self.loc(), who, lag)

    def lag(self, text: str) -> int:
        if text == "":
            return 0
        if not re.fullmatch(r"[+-]\d+", text):
            raise self.fail(text, "expected an item 'it', 'it+N' or 'it-N'")
        return int(text)

    def sync(self, text: str, phase: Phase, model: SyncModel) -> Sync:
        words = text.split(" ")
        try:
            kind = model.kind_named(words[0])
        except KeyError:
            raise self.fail(text, "not a sync of this target") from None
        groups = 0
        rest = words[1:]
        if kind.counted:
            if not rest:
                raise self.fail(text, "a counted wait needs its count")
            groups, rest = self.number(rest[0]), rest[1:]
        sync = Sync(kind, phase, (), self.loc(), groups)
        if len(rest) >= 2 and rest[-2] == "by":
            sync = replace(sync, who=self.enum(Threads, rest[-1]))
            rest = rest[:-2]
        for word in rest:
            if "=" not in word:
                raise self.fail(text, "not a sync of this target")
            key, _, value = word.partition("=")
            match key:
                case "bar":
                    m = re.fullmatch(r"(\w+)(?:\[it([+-]\d+)?\]|\[t%(\d+)\])?", value)
                    if m is None:
                        raise self.fail(
                            word, "expected bar=NAME, bar=NAME[it+N] or bar=NAME[t%SLOTS]"
                        )
                    if m[3] is not None:  # a per-tile barrier in a ring of tiles
                        sync = replace(sync, barrier=m[1], slots=self.number(m[3]))
                        continue
                    lag = None if "[" not in value else self.lag(m[2] or "")
                    sync = replace(sync, barrier=m[1], lag=lag)
                case "id":
                    m = re.fullmatch(r"(\d+)(\+wg|\+\(wg\+(\d+)\)%W)?", value)
                    if m is None:
                        raise self.fail(word, "expected id=N, id=N+wg or id=N+(wg+P)%W")
                    peer = None if m[2] is None else int(m[3] or 0)
                    sync = replace(sync, bar_id=int(m[1]), peer=peer)
                case "parity":
                    sync = replace(sync, parity=self.enum(Parity, value))
                case "count":
                    sync = replace(sync, count=self.number(value))
                case "tx":
                    sync = replace(sync, tx=self.number(value))
                case _:
                    raise self.fail(word, "unknown sync argument")
        return sync

    def hazard(self, line: str, steps: list[Step]) -> Hazard:
        m = _HAZARD.match(line)
        if m is None:
            raise self.fail(line, "expected 'serves KIND on BUF: op -> op (...)'")
        bufs = m["bufs"]
        if bufs.endswith(" (aliased)"):
            earlier_buffer, _, later_buffer = bufs[: -len(" (aliased)")].partition("/")
        else:
            earlier_buffer = later_buffer = bufs
        earlier = self.enum(Op, m["earlier"])
        scopes = {
            "warps cross": Scope.CTA,
            "within each warp": Scope.WARP,
            "within each warpgroup": Scope.WARPGROUP,
        }
        who = m["who"]
        return Hazard(
            kind=HazardKind(m["kind"]),
            earlier=earlier,
            later=self.enum(Op, m["later"]),
            earlier_buffer=earlier_buffer,
            later_buffer=later_buffer,
            scope=scopes.get(who, Scope.CTA),
            back_edge=m["edge"] is not None,
            async_write=any(s.op is earlier and s.is_async for s in steps),
            across="" if who in scopes else who,
        )


class _Served:
    """A sync whose hazard lines are read later; ``indices`` index the pending list."""

    def __init__(self, sync: Sync | _Served, index: int) -> None:
        if isinstance(sync, _Served):
            self.sync, self.indices = sync.sync, (*sync.indices, index)
        else:
            self.sync, self.indices = sync, (index,)


def _resolve(item, hazards: list[Hazard]) -> Item:
    if isinstance(item, _Served):
        return replace(item.sync, serves=tuple(hazards[i] for i in item.indices))
    return item
