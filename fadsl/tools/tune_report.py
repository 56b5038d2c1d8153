"""What `fadsl tune` reports: each candidate met, the result object, its table, and the winner's
spec with a header that names the GPU, the workload and the figures."""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from .._version import __version__
from ..pipeline import Compiled
from .tune_measure import FINAL, REFERENCES, SCREEN, Contender, Workload, geomean
from .variants import Variant

SHOWN_ROWS = 12  # the table's candidates beside the input and the winner


@dataclass(eq=False)
class Candidate:
    """A spec met by the search (the input, or a variant) and what became of it."""

    variant: Variant
    status: str = "pending"  # OK once built; REJECTED, SPILLS, FAILED, NOT_COMPILED, ...
    reason: str = ""
    compiled: Compiled | None = None
    # seqlen -> (TF/s, the input's TF/s in the same run), per method
    screen: dict[int, tuple[float, float]] = field(default_factory=dict)
    final: dict[int, tuple[float, float]] = field(default_factory=dict)
    expanded: bool = False

    @property
    def name(self) -> str:
        return self.variant.name

    def score(self, seqlens: Sequence[int], method: str = SCREEN) -> float | None:
        """The geometric mean over ``seqlens`` of the ratio to the input, None until every
        seqlen is measured."""
        records = self.screen if method == SCREEN else self.final
        if any(s not in records for s in seqlens):
            return None
        return geomean(records[s][0] / records[s][1] for s in seqlens)

    def contender(self) -> Contender:
        return Contender(self.name, self.compiled, self.variant.knobs)


@dataclass
class TuneResult:
    device: str
    workload: Workload
    input: Candidate
    winner: Candidate
    candidates: list[Candidate]  # every variant met, the input first, with its status
    # reference name -> seqlen -> (its TF/s, the input's TF/s in that run)
    references: dict[str, dict[int, tuple[float, float]]]
    rounds: int
    pruned: Counter  # why variants were refused before compiling -> how many
    repaired: int
    budget_spent: bool
    seconds: float
    spec_text: str  # the winner's spec, with its header

    @property
    def winner_name(self) -> str:
        return self.winner.name

    def counts(self) -> Counter:
        """Candidates by status (ok, rejected, spills, failed, not compiled ...)."""
        return Counter(c.status for c in self.candidates[1:])

    def rows(self) -> list[dict[str, Any]]:
        """One row per measured spec, best first: TF/s and the ratios per seqlen, and their
        geometric means; ``method`` FINAL (timed with the references) or SCREEN."""
        seqlens = self.workload.seqlens
        rows = []
        for c in self.candidates:
            method = FINAL if c.score(seqlens, FINAL) is not None else SCREEN
            if c.score(seqlens, method) is None:
                continue
            records = c.final if method == FINAL else c.screen
            x_input = {s: records[s][0] / records[s][1] for s in seqlens}
            # the input's TF/s and its ratio to each reference come from the final round; a
            # screened row reaches the references through its ratio to the input
            if method == FINAL:
                tflops = {s: records[s][0] for s in seqlens}
            else:
                base = self.input.final
                tflops = {s: x_input[s] * base[s][0] if s in base else None for s in seqlens}
            x_refs = {}
            for ref, by_seqlen in self.references.items():
                per = {
                    s: x_input[s] * by_seqlen[s][1] / by_seqlen[s][0]
                    for s in seqlens
                    if s in by_seqlen
                }
                x_refs[ref] = {"by_seqlen": per, "mean": geomean(per.values())}
            rows.append(
                {
                    "name": c.name,
                    "changes": c.variant.describe(),
                    "method": method,
                    "input": c is self.input,
                    "winner": c is self.winner,
                    "tflops": tflops,
                    "x_input": {"by_seqlen": x_input, "mean": geomean(x_input.values())},
                    "x": x_refs,
                }
            )
        rows.sort(key=lambda r: (r["method"] != FINAL, -r["x_input"]["mean"]))
        return rows

    def summary(self) -> str:
        counts = self.counts()
        met = len(self.candidates) - 1
        pruned = sum(self.pruned.values())
        why = ", ".join(f"{n} by {reason}" for reason, n in self.pruned.most_common())
        timed = sum(1 for c in self.candidates[1:] if c.score(self.workload.seqlens) is not None)
        minutes = f"{int(self.seconds // 60)}:{int(self.seconds % 60):02d}"
        text = (
            f"{self.rounds} round{'s' * (self.rounds != 1)}, {met} variants passed the checks; "
            f"{pruned} moves pruned ({why or 'none'}), {self.repaired} repaired; "
            f"{counts.get('ok', 0)} built (or measured before), "
            f"{counts.get('spills', 0)} spill, {counts.get('rejected', 0)} refused by the "
            f"passes, {counts.get('failed', 0)} failed; {timed} timed; {minutes}"
        )
        cut = sum(v for k, v in counts.items() if "budget" in k)
        if self.budget_spent:
            text += f" (budget spent: {cut} variants not compiled or not timed)"
        return text

    def table(self) -> str:
        seqlens = self.workload.seqlens
        refs = [r for r in REFERENCES if r in self.references]
        rows = self.rows()
        shown = [r for r in rows if not (r["input"] or r["winner"])][:SHOWN_ROWS]
        shown = [r for r in rows if r["input"] or r["winner"] or r in shown]
        width = max([len(r["name"]) for r in shown] + [6]) + 8
        head = f"{'kernel':<{width}}" + "".join(f"{s:>8}" for s in seqlens)
        head += f"{'x input':>9}" + "".join(f"{'x ' + REFERENCES[r]:>14}" for r in refs) + "  timed"
        lines = [
            f"fadsl tune: {self.input.name} on {self.device} ({self.workload.text()})",
            self.summary(),
            "",
            head,
        ]
        for r in shown:
            mark = " (input)" if r["input"] else " (winner)" if r["winner"] else ""
            line = f"{r['name'] + mark:<{width}}"
            line += "".join(_number(r["tflops"].get(s), 8, 1) for s in seqlens)
            line += _number(r["x_input"]["mean"], 9, 3)
            line += "".join(_number(r["x"].get(ref, {}).get("mean"), 14, 2) for ref in refs)
            lines.append(line + f"  {r['method']}")
        hidden = len(rows) - len(shown)
        if hidden:
            lines.append(f"... and {hidden} more measured variants")
        lines.append(
            "TF/s per seqlen; x: geometric means over the seqlens of the ratios; final: timed "
            "together with the references by bench's full method; screen: short runs against "
            "the input (ratios to the references through the input's)"
        )
        winner = next(r for r in rows if r["winner"])
        lines += ["", f"winner {self.winner.name}: {self.winner.variant.describe()}"]
        lines.append(
            f"{'seqlen':>7}{'TF/s':>9}{'x input':>9}"
            + "".join(f"{'x ' + REFERENCES[r]:>14}" for r in refs)
        )
        for s in seqlens:
            line = f"{s:>7}" + _number(winner["tflops"].get(s), 9, 1)
            line += _number(winner["x_input"]["by_seqlen"].get(s), 9, 3)
            line += "".join(
                _number(winner["x"].get(ref, {}).get("by_seqlen", {}).get(s), 14, 2) for ref in refs
            )
            lines.append(line)
        return "\n".join(lines)


def _number(value: float | None, width: int, digits: int) -> str:
    if value is None or value != value:  # missing, or NaN
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}"


def spec_with_header(result: TuneResult, file: str) -> str:
    """The winner's spec text behind comment lines that say where it comes from: the GPU,
    the workload, what changed and the figures of the final round."""
    seqlens = result.workload.seqlens
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    winner = next((r for r in result.rows() if r["winner"]), None)
    slash = " / ".join
    timed = sum(1 for c in result.candidates if c.score(seqlens) is not None)
    lines = [
        f"# Tuned by `fadsl tune` (fadsl {__version__}) on {result.device}, {date}: the fastest "
        f"of {timed} specs timed",
        f"# from {result.input.name} ({file}), for {result.workload.text()}.",
    ]
    if result.winner is result.input:
        lines.append("# No variant beat the input: the spec as it was.")
    else:
        lines.append(f"# Changed: {result.winner.variant.describe()}.")
    if winner is not None:
        figures = [
            f"TF/s at seqlen {slash(map(str, seqlens))}: "
            + slash(_short(winner["tflops"].get(s), 0) for s in seqlens),
            f"x {result.input.name} "
            + slash(_short(winner["x_input"]["by_seqlen"].get(s), 3) for s in seqlens),
        ]
        for ref, per in winner["x"].items():
            figures.append(
                f"x {REFERENCES[ref]} " + slash(_short(per["by_seqlen"].get(s), 2) for s in seqlens)
            )
        lines += [f"# {text}" for text in figures]
    return "\n".join(lines) + "\n" + result.winner.variant.text


def _short(value: float | None, digits: int) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"
