"""Instruction census of the sm_90a backward's consumer m-block loop (SASS, per thread).

Usage: python research/probes/bwd_sass_census.py SPEC... [--defines "NAME=1 ..."] [--list]
For each spec: the main backward kernel's cubin for sm_90a as the runtime builds it (NVRTC;
with --defines, default $PROBE_DEFINES, a development build as research/probes/
probe_backward.py's), disassembled with nvdisasm (fadsl/tools/sass.py); the consumers'
m-block loop (the smallest loop without an EXIT that holds every HGMMA and the 2^x: with
`scheduler persistent` the tile loop holds it), and the paths through it from its head to its
back branch (each forward conditional branch inside the loop taken or not; branches that
leave the loop, the mbarrier waits' retry paths, not taken): per distinct path the
instructions a thread issues per m-block, by category and by Nsight Compute's pipe as they
matched its counts (PIPES), ptxas's spills and the highest register the loop names (the
consumers run under setmaxnreg; ptxas's "Used N registers" is the launch allocation).
--list prints each path's instructions. Needs no GPU.

CENSUS_CHECKOUT=1 PYTHONPATH=OTHER_CHECKOUT runs another checkout's fadsl and headers (an
older commit in a `git worktree add --detach`) in place of the editable install's.
research/backward-sass-census.md has the census of 2026-11-30.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

if os.environ.get("CENSUS_CHECKOUT"):  # another checkout's fadsl and emit/ (PYTHONPATH)
    sys.meta_path[:] = [
        f
        for f in sys.meta_path
        if "editable" not in (type(f).__module__ + str(getattr(f, "__name__", ""))).lower()
    ]

import fadsl
from fadsl.tools import sass

# (category, predicate on the instruction's text); the first that matches wins
CATEGORIES: list[tuple[str, re.Pattern]] = [
    ("wgmma", re.compile(r"^(HGMMA|QGMMA)")),
    ("wgmma sync", re.compile(r"^WARPGROUP\.")),
    ("mbarrier/bar", re.compile(r"^(SYNCS\.|BAR\.|MEMBAR|FENCE|ERRBAR|CCTL)")),
    ("exp2 (MUFU)", re.compile(r"^MUFU")),
    ("fp32 math", re.compile(r"^(FFMA|FADD|FMUL|FMNMX|FSETP|FCHK)")),
    ("mask select", re.compile(r"^(FSEL|SEL)")),
    ("bf16 pack", re.compile(r"^F2FP")),
    ("LDS (LSE, D)", re.compile(r"^LDS")),
    ("stmatrix/STS", re.compile(r"^(STSM|STS)")),
    ("red.global", re.compile(r"^(REDG|RED|ATOMG)")),
    ("uniform", re.compile(r"^(U[A-Z0-9]|R2UR|S2UR)")),
    (
        "int/addr (ALU)",
        re.compile(
            r"^(IMAD|IADD|LEA|LOP|SHF|VIADD|IMNMX|VIMNMX|ISETP|MOV|PLOP|P2R|R2P|S2R|LDC|CS2R"
            r"|PRMT|BMSK|SGXT|FLO|POPC|BREV|I2F|F2I|IABS)"
        ),
    ),
    ("shuffle", re.compile(r"^SHFL")),
    ("branch", re.compile(r"^(BRA|BSSY|BSYNC|WARPSYNC|EXIT|NOP|YIELD|RET|CALL)")),
]


# Nsight Compute's pipes as they matched its counts of fa3_hopper's main kernel at 9cb652c
# (docs/performance.md, "Sustained beside FA4": ALU 0.76 G, FMA 0.70 G, uniform 0.41 G against
# this census x 3.36 M warp m-blocks: 0.75, 0.70, 0.40 G): UMOV in none of them, R2UR in ALU,
# VIADD and IMAD in FMA
PIPES: list[tuple[str, re.Pattern]] = [
    ("fma", re.compile(r"^(FFMA|FADD|FMUL|IMAD|VIADD|HFMA2|HMUL2|HADD2)")),
    (
        "alu",
        re.compile(
            r"^(LOP3|SHF|LEA|IADD3|ISETP|FSETP|VIMNMX|IMNMX|FMNMX|F2FP|FSEL|SEL|R2UR|MOV|PRMT"
            r"|PLOP3|P2R|R2P|IABS|FLO|POPC|BREV|BMSK|SGXT)"
        ),
    ),
    ("uniform", re.compile(r"^(?!UMOV)U[A-Z]")),
    ("umov", re.compile(r"^UMOV")),
    ("xu", re.compile(r"^MUFU")),
]


def pipe(text: str) -> str:
    for name, pattern in PIPES:
        if pattern.match(text):
            return name
    return "rest"


def category(text: str) -> str:
    for name, pattern in CATEGORIES:
        if pattern.match(text):
            return name
    return "other"


_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:(?P<pred>@!?U?P[0-9T])\s+)?(?P<text>[^;]*);")
_LABEL = re.compile(r"^(?P<label>\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((?P<label>\.L_x_\d+)\)")


def function(text: str, name: str) -> str:
    start = text.index(f".text.{name}:")
    end = text.find("//----", start)
    return text[start : end if end >= 0 else len(text)]


def parse(fn: str):
    """Instructions as (pred, text), labels' indices."""
    ins, labels = [], {}
    for line in fn.splitlines():
        if m := _LABEL.match(line):
            labels[m["label"]] = len(ins)
        elif m := _LINE.match(line):
            ins.append((m["pred"], " ".join(m["text"].split())))
    return ins, labels


def paths(ins, labels, start: int, end: int, limit: int = 64):
    """Paths from `start` to the back branch at `end` (inclusive), as index lists (at most
    `limit`: the first found, each forward conditional branch not taken first)."""
    found = []

    def walk(i, taken, seen):
        if len(found) >= limit:
            return
        path = []
        while True:
            if i > end or i < start:
                return  # left the loop (not a path of the m-block loop)
            pred, text = ins[i]
            path.append(i)
            if i == end:
                found.append(taken + path)
                return
            if b := _BRANCH.search(text):
                target = labels[b["label"]]
                inside = start <= target <= end
                if pred is None:
                    if not inside:
                        return
                    if (i, target) in seen:
                        return
                    taken, path, seen = taken + path, [], seen | {(i, target)}
                    i = target
                    continue
                # a forward conditional branch: both ways (not taken first)
                if inside and target > i:
                    walk(i + 1, taken + path, seen)
                    walk(target, taken + path, seen)
                    return
                # a branch out of the loop (a retry path), or backwards (an inner loop): not taken
            i += 1

    walk(start, [], frozenset())
    return found


def census(spec: str, defines: dict[str, str]):
    kern = fadsl.load(spec, verbose=False)
    bk = kern._backward_kernels()
    dtype = kern.config.dtypes[0]
    if defines:
        bk.use_development_build(dtype, "sm_90a", defines)
    entry = bk.cubin(dtype, "sm_90a")
    name = bk._sources[dtype].kernel_name
    text = sass.disassemble(entry.cubin, sass.nvdisasm())
    fn = function(text, name)
    ins, labels = parse(fn)
    # the m-block loop: of the loops without an EXIT that issue every HGMMA of the body and
    # 2^x, the smallest (with `scheduler persistent` the tile loop holds it)
    found = [
        lp
        for lp in sass.loops(fn)
        if lp.count("HGMMA") and lp.count("MUFU.EX2") and not lp.count("EXIT")
    ]
    most = max(x.count("HGMMA") for x in found)
    lp = min((x for x in found if x.count("HGMMA") == most), key=lambda x: len(x.instructions))
    start, end = lp.start, lp.end - 1
    log = entry.log or ""
    regs = re.findall(
        rf"Function properties for {name}\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
        r"(\d+) bytes spill loads\n.*?Used (\d+) registers",
        log,
        re.S,
    )
    # the highest general register the loop names (the consumers run under setmaxnreg 240:
    # ptxas's "Used N registers" is the launch allocation)
    named = (int(r) for _, t in ins[start : end + 1] for r in re.findall(r"\bR(\d+)\b", t))
    top = max(named, default=-1)
    regs = [(*r, f"loop's highest R{top}") for r in regs]
    return name, lp, [(p, [ins[i] for i in p]) for p in paths(ins, labels, start, end)], regs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--defines", default=os.environ.get("PROBE_DEFINES", ""))
    parser.add_argument("--list", action="store_true", help="print each path's instructions")
    args = parser.parse_args()
    defines = dict(d.split("=") for d in args.defines.split())
    names = [n for n, _ in CATEGORIES] + ["other"]
    for spec in args.specs:
        name, lp, found, regs = census(spec, defines)
        spills = ", ".join(
            f"{st}/{ld} bytes spilled, launch {n} registers, {top}" for _, st, ld, n, top in regs
        )
        head = f"loop {lp.label}, {len(lp.instructions)} static instructions"
        print(f"== {name} {defines or ''}: {head}; {spills}")
        seen = {}
        for p, texts in found:
            key = tuple(t for _, t in texts)
            if key in seen:
                continue
            seen[key] = True
            c = Counter(category(t) for _, t in texts)
            k = Counter(pipe(t) for _, t in texts)
            kind = "masked" if c["mask select"] else "unmasked"
            counts = ", ".join(f"{n} {c[n]}" for n in names if c[n])
            print(f"  {kind} path, {len(texts)} instructions: {counts}")
            pipes = ("fma", "alu", "uniform", "umov", "xu", "rest")
            print("    pipes: " + ", ".join(f"{n} {k[n]}" for n in pipes))
            if args.list:
                for pred, t in texts:
                    print(f"      {category(t):<16} {pred or '':<5} {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
