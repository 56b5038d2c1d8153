"""The spec matrix the general GPU tests build: head dims x masks, from the examples.

Head dims 64, 96 and 128 vary the swizzled example (whole tiles in registers); 256 is the
head_dim 256 example (fragment-wise loads, loads ahead), and `pipelined` the head_dim 128
kernel with FA2's schedule, so that tails and causal masks run through every kind of load.
``sm90_specs()``: the 16-bit sm_90a examples (and ``EXTRA_SM90``) with and without the causal
mask.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWIZZLED = (ROOT / "examples" / "fa2_swizzled.fa").read_text()
# 96-element rows: 32-element spans (FlashAttention's Swizzle<2, 3, 3>), whole in every row.
SWIZZLE = {64: "xor(3, 3, 3)", 96: "xor(2, 3, 3)", 128: "xor(3, 3, 4)"}
OTHERS = {"d256": "fa2_hdim256", "pipelined": "fa2_pipelined"}
# Not an example (yet): Q in a ring of two tiles (q_slots 2), run by the sm_90a GPU tests too.
Q_RING = "tests/specs/sm90/fa3_q_ring.fa"
# Not examples either, run like them: Q's ring, FlashAttention-3's 128 x 176 tile at head_dim
# 128 (B_c not a multiple of 64, O over the dead V ring), and two CTAs an SM (ctas_per_sm 2).
EXTRA_SM90 = (
    Q_RING,
    "tests/specs/bench/fa3_hopper_bc176.fa",
    "tests/specs/bench/fa3_hdim64_causal_2cta.fa",
)


def is_8bit(text: str) -> bool:
    """An FP8 spec (`dtype e4m3` / `e5m2`): tests/test_gpu_fp8.py runs those, with 8-bit
    inputs and descales; the 16-bit suites leave them out."""
    return re.search(r"^\s*dtype\s+e[45]m", text, re.MULTILINE) is not None


def whole_tail(text: str) -> str:
    """The spec with `tail whole` where it has `tail split_kv` (split pieces run without a
    mask only, and combine their partial results in another order than one CTA does)."""
    return re.sub(r"^(\s*tail\s+)split_kv\b", r"\g<1>whole", text, flags=re.MULTILINE)


def _masked(name: str, text: str, kernel: str, mask: str) -> str:
    text = text.replace(f"kernel {kernel}", f"kernel {name}")
    return text.replace("mask     none", f"mask     {mask}")


def general_specs() -> dict[str, str]:
    specs = {}
    for mask in ("none", "causal"):
        for head_dim, swizzle in SWIZZLE.items():
            name = f"general_d{head_dim}_{mask}"
            text = SWIZZLED.replace("head_dim 128", f"head_dim {head_dim}")
            text = text.replace("swizzle xor(3, 3, 4)", f"swizzle {swizzle}")
            specs[name] = _masked(name, text, "fa2_swizzled", mask)
        for label, example in OTHERS.items():
            name = f"general_{label}_{mask}"
            text = (ROOT / "examples" / f"{example}.fa").read_text()
            specs[name] = _masked(name, text, example, mask)
    return specs


def sm90_specs() -> dict[str, str]:
    """Every sm_90a example, and each with its mask flipped (named ``<example>_causal`` or
    ``<example>_full``), so that every head dim runs with and without the causal mask; a
    flipped spec that another example already is (fa3_causal is fa3_hopper, causal) is
    left out."""
    return _sm90_specs_and_flips()[0]


def mask_flipped(stem: str) -> str:
    """The name in ``sm90_specs()`` of example ``stem`` with its mask flipped: another
    example where that is the same kernel (fa3_causal without its mask is fa3_hopper)."""
    return _sm90_specs_and_flips()[1][stem]


def _sm90_specs_and_flips() -> tuple[dict[str, str], dict[str, str]]:
    examples = {}
    for path in sorted((ROOT / "examples").glob("*.fa")) + [ROOT / p for p in EXTRA_SM90]:
        text = path.read_text()
        if re.search(r"^\s*target\s+sm_90a\b", text, re.MULTILINE) and not is_8bit(text):
            examples[path.stem] = text
    specs = dict(examples)
    seen = {spec_body(text): stem for stem, text in examples.items()}
    flips = {}
    for stem, text in examples.items():
        causal = is_causal(text)
        name = f"{stem}_{'full' if causal else 'causal'}"
        if name in examples:  # an example already goes by that name (fa3_hdim64_causal)
            name += "_flipped"
        flipped = whole_tail(mask_flipped_spec(text, name))
        if not causal:
            flipped = single_ctas(flipped)  # clusters pair tiles of equal length only
        if spec_body(flipped) not in seen:
            seen[spec_body(flipped)] = name
            specs[name] = flipped
        flips[stem] = seen[spec_body(flipped)]
    return specs, flips


def is_causal(text: str) -> bool:
    return re.search(r"^\s*mask\s+causal\b", text, re.MULTILINE) is not None


def mask_flipped_spec(text: str, name: str) -> str:
    """The spec with its mask flipped (none <-> causal), its kernel called ``name``."""
    causal = is_causal(text)
    flipped = re.sub(
        r"^(\s*mask\s+)(none|causal)\b",
        lambda m: m.group(1) + ("none" if causal else "causal"),
        text,
        count=1,
        flags=re.MULTILINE,
    )
    return re.sub(r"\bkernel\s+\w+", f"kernel {name}", flipped, count=1)


def single_ctas(text: str) -> str:
    """The spec without `cluster N`: K and V in smem[cta]."""
    text = re.sub(r"^\s*cluster\s+\d+[^\n]*\n", "", text, flags=re.MULTILINE)
    return text.replace("smem[cluster]", "smem[cta]")


def spec_body(text: str) -> str:
    """A spec without its comments, name and blank space (to find duplicates)."""
    text = re.sub(r"#[^\n]*", "", text)
    text = re.sub(r"\bkernel\s+\w+", "kernel _", text, count=1)
    return " ".join(text.split())


RESCALE_MODES = ("every", "lazy", "guarded")
# Not examples: the shape issue 28 saw lose rows (causal head_dim 128, Q ring, B_c = 96); the
# varlen head_dim 64 spec, the one kernel whose Q descriptors are rebuilt each block (its
# padded calls run it as one packed batch).
EXTRA_NUMERICS = (
    "tests/specs/sm90/fa3_causal_q_ring_bc96.fa",
    "examples/serving/fa3_varlen_hdim64.fa",
)


def with_rescale(text: str, mode: str) -> str:
    """The spec with `rescale mode` (set, or added before its closing brace)."""
    if re.search(r"^\s*rescale\s+\w+", text, re.MULTILINE):
        return re.sub(r"^(\s*rescale\s+)\w+", rf"\g<1>{mode}", text, count=1, flags=re.MULTILINE)
    return re.sub(r"\}\s*$", f"  rescale    {mode}\n}}\n", text)


def rescale_of(text: str) -> str:
    found = re.search(r"^\s*rescale\s+(\w+)", text, re.MULTILINE)
    return found.group(1) if found else "lazy"


def numerics_specs() -> dict[str, str]:
    """The numerics suite's kernels: every sm_90a spec of ``sm90_specs()`` (the examples,
    each with its mask flipped, the extra specs) and ``EXTRA_NUMERICS``, each in every
    rescale mode (named ``<spec>_<mode>`` where the mode is not its own); every sm_80
    example with its mask flipped too (sm_80 rescales every block)."""
    specs = {}
    sm90 = dict(sm90_specs())
    for path in EXTRA_NUMERICS:
        sm90[Path(path).stem] = (ROOT / path).read_text()
    for stem, text in sm90.items():
        for mode in RESCALE_MODES:
            if mode == rescale_of(text):
                specs[stem] = text
            else:
                name = f"{stem}_{mode}"
                renamed = re.sub(r"\bkernel\s+\w+", f"kernel {name}", text, count=1)
                specs[name] = with_rescale(renamed, mode)
    for path in sorted((ROOT / "examples").glob("fa2_*.fa")):
        text = path.read_text()
        specs[path.stem] = text
        name = f"{path.stem}_{'full' if is_causal(text) else 'causal'}"
        flipped = mask_flipped_spec(text, name)
        if spec_body(flipped) not in {spec_body(t) for t in specs.values()}:
            specs[name] = flipped
    return specs


def softcap_specs() -> dict[str, str]:
    """The capped specs (tests/specs/sm90/fa3_softcap*.fa), each in every rescale mode, named
    ``<spec>_<mode>``."""
    specs = {}
    for path in sorted((ROOT / "tests" / "specs" / "sm90").glob("fa3_softcap*.fa")):
        for mode in RESCALE_MODES:
            name = f"{path.stem}_{mode}"
            text = re.sub(r"\bkernel\s+\w+", f"kernel {name}", path.read_text(), count=1)
            specs[name] = with_rescale(text, mode)
    return specs


# Sliding windows beyond the spec files' (each from tests/specs/sm90/fa3_window.fa, or the
# example named, with its mask line, and more, replaced): name -> (mask, rescale, the lines).
WINDOW_VARIANTS = {
    # a window narrower than a block: every iteration masks at both ends at once
    "fa3_window_small": ("window(3, 5)", "guarded", {}),
    # left 0 with the causal mask: each query sees its diagonal key alone
    "fa3_window_left0": ("causal, window(0)", "lazy", {}),
    # left 0, a right side only
    "fa3_window_right": ("window(0, 200)", "every", {}),
    # wider than any sequence tested: the same as no mask
    "fa3_window_huge": ("window(100000, 100000)", "guarded", {}),
    # one CTA per tile (the grid's order: plain, as the persistent one's)
    "fa3_window_grid": ("causal, window(300)", "every", {"scheduler": "grid"}),
    # 192 query rows a tile over blocks of 128 keys: a tile's first rows see nothing in its
    # first blocks (examples/fa3_hdim64.fa, its tail whole)
    "fa3_window_hdim64_br192": ("window(500, 100)", "guarded", {"tail": "whole"}),
}
WINDOW_BASES = {"fa3_window_hdim64_br192": "examples/fa3_hdim64.fa"}


def window_of(text: str) -> tuple[int, int] | None:
    """A spec's window as (left, right), right 0 with the causal mask; None without one."""
    found = re.search(r"^\s*mask\s+([^#\n]*)", text, re.MULTILINE)
    sizes = re.search(r"window\((\d+)(?:,\s*(\d+))?\)", found.group(1)) if found else None
    return None if sizes is None else (int(sizes.group(1)), int(sizes.group(2) or 0))


def with_setting(text: str, key: str, value: str) -> str:
    """The spec with ``key value`` (its line replaced, the comment dropped)."""
    replaced, n = re.subn(
        rf"^(\s*{key}\s+)[^\n]*", rf"\g<1>{value}", text, count=1, flags=re.MULTILINE
    )
    assert n == 1, key
    return replaced


def forward_only(text: str) -> str:
    """The spec without its backward block (a window's backward is not built)."""
    return re.sub(r"^[ \t]*backward\s*\{[^}]*\}[^\n]*\n", "", text, flags=re.MULTILINE)


def window_specs() -> dict[str, str]:
    """The windowed specs (tests/specs/sm90/fa3_window*.fa) each in every rescale mode, named
    ``<spec>_<mode>``, and ``WINDOW_VARIANTS`` in one mode each."""
    specs = {}
    for path in sorted((ROOT / "tests" / "specs" / "sm90").glob("fa3_window*.fa")):
        for mode in RESCALE_MODES:
            name = f"{path.stem}_{mode}"
            text = re.sub(r"\bkernel\s+\w+", f"kernel {name}", path.read_text(), count=1)
            specs[name] = with_rescale(text, mode)
    for name, (mask, mode, lines) in WINDOW_VARIANTS.items():
        base = ROOT / WINDOW_BASES.get(name, "tests/specs/sm90/fa3_window.fa")
        text = re.sub(r"\bkernel\s+\w+", f"kernel {name}", base.read_text(), count=1)
        text = with_rescale(with_setting(forward_only(text), "mask", mask), mode)
        for key, value in lines.items():
            text = with_setting(text, key, value)
        specs[name] = text
    return specs
