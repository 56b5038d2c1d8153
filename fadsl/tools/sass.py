"""A cubin's SASS, read for the structure of its loops (nvdisasm's text; a development aid).

What ptxas makes of the consumers' mainloop decides a good part of an sm_90a kernel's
speed, and small source changes move it. On 2026-11-23 an unsigned ring index made ptxas
hoist the P V wait (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) above the whole softmax in
fa3_hopper, so the softmax no longer overlapped the warpgroup's own P V: -3 to -5 %.
``softmax_overlap`` counts that overlap; ``research/probes/sass_loops.py`` prints it with each
loop's size, and tests/test_sass.py keeps it in every sm_90a example.

nvdisasm comes with the CUDA toolkit, or as NVIDIA's ``nvidia-cuda-nvdisasm`` wheel.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:(?P<pred>@!?U?P[0-9T])\s+)?(?P<text>[^;]*);")
_LABEL = re.compile(r"^(?P<label>\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((?P<label>\.L_x_\d+)\)")

# The softmax's arithmetic: row max, scale, 2^x, row sum.
SOFTMAX_OPS = ("FMNMX", "FFMA", "MUFU.EX2", "FADD")
QK_DONE = "WARPGROUP.DEPBAR.LE gsb0, 0x1"  # S = Q K^T is in; P V may still run
PV_DONE = "WARPGROUP.DEPBAR.LE gsb0, 0x0"  # every wgmma group is in


@dataclass(frozen=True)
class Loop:
    """The instructions from a label to the backward branch that returns to it."""

    label: str
    start: int  # index of its first instruction in the function
    instructions: tuple[str, ...]  # the text of each, predicate left out

    @property
    def end(self) -> int:
        return self.start + len(self.instructions)

    def count(self, *prefixes: str) -> int:
        return sum(1 for text in self.instructions if text.startswith(prefixes))

    @property
    def uniform(self) -> int:
        """Instructions of the uniform datapath (UIADD3, ULOP3, UMOV, ...)."""
        return sum(1 for text in self.instructions if re.match(r"U[A-Z]", text))


def instructions(sass: str) -> tuple[list[str], dict[str, int], list[tuple[int, str]]]:
    """The instructions' texts in order, each label's index (the instruction after it) and
    each branch as (index, target label)."""
    texts: list[str] = []
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    for line in sass.splitlines():
        if label := _LABEL.match(line):
            labels[label["label"]] = len(texts)
            continue
        if ins := _LINE.match(line):
            text = " ".join(ins["text"].split())
            if branch := _BRANCH.search(text):
                branches.append((len(texts), branch["label"]))
            texts.append(text)
    return texts, labels, branches


def loops(sass: str) -> list[Loop]:
    """Every loop (a branch back to a label above it), in the order of their labels."""
    texts, labels, branches = instructions(sass)
    found = {}
    for index, label in branches:
        start = labels.get(label)
        if start is not None and start <= index:
            found[label] = Loop(label, start, tuple(texts[start : index + 1]))
    return sorted(found.values(), key=lambda loop: loop.start)


def mainloops(sass: str) -> list[Loop]:
    """The consumers' mainloops: the innermost loops that issue wgmma (HGMMA, or the FP8
    kernels' QGMMA) and compute 2^x. In a
    generated sm_90a kernel: the masked iterations', then the others'. Left out: the tile
    loop around them, and the "loops" of an mbarrier wait's retry path, whose branch back
    sits after the function's EXIT."""
    candidates = [
        loop
        for loop in loops(sass)
        if loop.count("HGMMA", "QGMMA") and loop.count("MUFU.EX2") and not loop.count("EXIT")
    ]
    return innermost(candidates)


def softmax_overlap(loop: Loop) -> int | None:
    """How many softmax instructions a loop issues after S = Q K^T is in and before it
    waits for P V: the part of the softmax that overlaps the warpgroup's own P V. None
    when the loop has not both waits."""
    texts = loop.instructions
    try:
        first = texts.index(QK_DONE)
        second = texts.index(PV_DONE, first)
    except ValueError:
        return None
    return sum(1 for text in texts[first:second] if text.startswith(SOFTMAX_OPS))


def function(sass: str, name: str) -> str:
    """The listing of the function ``name`` in a disassembled cubin (nvdisasm -c), up to the
    next function's section."""
    return sass.split(f".text.{name}:", 1)[1].split(".text.", 1)[0]


def innermost(found: list[Loop]) -> list[Loop]:
    """The loops of ``found`` that hold none of the others."""
    return [
        x
        for x in found
        if not any(y is not x and x.start <= y.start and y.end <= x.end for y in found)
    ]


def nvdisasm() -> str | None:
    """nvdisasm from PATH or from the nvidia-cuda-nvdisasm wheel; None if neither."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    roots = spec.submodule_search_locations if spec else ()
    found = [path for root in roots for path in sorted(Path(root).glob("cu*/bin/nvdisasm"))]
    return str(found[0]) if found else None


def disassemble(cubin: bytes, tool: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run(
            [tool, "-c", file.name], check=True, capture_output=True, text=True
        ).stdout
