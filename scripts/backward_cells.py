"""Issue 44's backward table from research/probes/bwd_vs_fa4.py's --json files, one per (spec,
sequence length) cell: a markdown row per spec, TF/s of fadsl, cuDNN and FA4 at each length,
and fadsl's ratio to each (a contender that did not run reads "-").

Usage: python3 scripts/backward_cells.py CELL.json ...   (scripts/device.sh bwdcells writes them)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONTENDERS = ("fadsl", "cudnn", "fa4")


def read_cells(paths: list[Path]) -> dict[str, dict[int, dict[str, float]]]:
    """spec name -> sequence length -> contender -> TF/s, in the order the files were given."""
    cells: dict[str, dict[int, dict[str, float]]] = {}
    for path in paths:
        data = json.loads(path.read_text())
        shape, summary = data["shape"], data["summary"]
        name = Path(shape["spec"]).stem
        cells.setdefault(name, {})[int(shape["seqlen"])] = {
            who: float(summary[who]["tflops"]) for who in CONTENDERS if who in summary
        }
    return cells


def _figures(values: list[float | None], digits: int) -> str:
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or theirs is None else ours / theirs


def table(cells: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [
        "| spec | seqlen | fadsl | cuDNN | FA4 | x cuDNN | x FA4 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, by_seqlen in cells.items():
        seqlens = sorted(by_seqlen)
        tf = {who: [by_seqlen[s].get(who) for s in seqlens] for who in CONTENDERS}
        ratio = {who: list(map(_ratio, tf["fadsl"], tf[who])) for who in ("cudnn", "fa4")}
        lengths = " / ".join(f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens)
        lines.append(
            f"| {name} | {lengths} | {_figures(tf['fadsl'], 1)} | {_figures(tf['cudnn'], 1)} | "
            f"{_figures(tf['fa4'], 1)} | {_figures(ratio['cudnn'], 2)} | {_figures(ratio['fa4'], 2)} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    print(table(read_cells([Path(a) for a in argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
