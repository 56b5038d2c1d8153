"""`fadsl bench`: time a spec's kernel against PyTorch's FlashAttention and cuDNN backends, and
FlashAttention-4 (flash_attn.cute) where it is installed.

Method (the seeds' appendix): for each sequence length, batch = tokens / seqlen,
random inputs rotated among enough buffer sets that L2 never holds the next
call's operands, a correctness check against a float32 reference before any
timing (a wrong kernel is never timed), then warm-up runs and timed runs with
CUDA events; the median is reported. All contenders run on the same tensors in
the same process. FLOPs = 4 * B * H * Sq * Sk * D (half that when causal). Where NVML is
there, the SM clock, power draw and power-cap share are sampled while each contender is timed
(fadsl/tools/clocks.py): a power-bound kernel runs at a lower clock.

Variants of a kernel (``against``: other specs of the same head_dim and mask) are timed as
more contenders on the same tensors, named ``fadsl:<kernel>``. Every contender is timed once
per round, and the median of its medians reported. An H100 under load sits at its power cap,
and the cap acts on a running average, so a contender's clock depends on what ran just before
it: the first after an idle gap runs fastest (seqlen 2048: 1980 MHz for the first, 1845-1890
for the third), and so does the one after a contender that draws little power. A rotated
order (until 2026-11-23) still had every contender follow the same one in every round (cuDNN
always followed PyTorch's FlashAttention-2 and ran at the highest clock at seqlen 2048,
2026-11-24). So the rounds follow a Williams design (``balanced_orders``): over its rounds
every contender comes first, and follows each other contender, equally often; by
default as many rounds as one full design takes (the contenders' count, twice that when odd).
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from . import clocks
from ..codegen.render import spec_hash
from ..ir import Dtype, Mask
from ..runtime.arguments import torch_dtype_of
from ..runtime.attention import FlashAttention

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEADS = 16


@dataclass
class Row:
    seqlen: int
    batch: int
    heads: int
    head_dim: int
    ms: dict[str, float] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    max_error: float = 0.0
    error_bound: float = 0.0
    # contender -> clocks.ClockSummary fields, over all its timed runs (NVML only)
    clocks: dict[str, dict] = field(default_factory=dict)
    rounds: int = 0  # every contender timed this many times
    balanced: bool = True  # the rounds were whole balanced designs (balanced_orders)


def flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    total = 4.0 * batch * heads * sq * sk * d
    return total / 2 if causal else total


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design for ``n`` contenders: n orders (2n when n is odd) of 0 .. n-1 in
    which each comes first equally often and each ordered pair (a, b) of distinct contenders
    is adjacent, a just before b, equally often (once; twice when n is odd)."""
    first = [0]
    for i in range(1, n):  # 0, 1, n-1, 2, n-2, ...
        first.append((i + 1) // 2 if i % 2 else n - i // 2)
    orders = [[(x + r) % n for x in first] for r in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders


def _time(
    fn: Callable[[int], object],
    sets: int,
    warmup: int,
    runs: int,
    sampler: clocks.Sampler | None = None,
) -> tuple[float, list[clocks.Reading]]:
    """Median milliseconds of ``fn(i)`` over ``runs`` calls, after ``warmup``, and the
    sampler's readings while they were queued and ran (the last warm-up calls may still be
    running when it starts: the same kernel)."""
    import torch

    for i in range(warmup):
        fn(i % sets)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    if sampler:
        sampler.start()
    for i in range(runs):
        starts[i].record()
        fn(i % sets)
        ends[i].record()
    torch.cuda.synchronize()
    readings = sampler.stop() if sampler else []
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), readings


def median_times(
    contenders: dict[str, Callable[[int], object]],
    warmup: int,
    runs: int,
    rounds: int | None = None,
) -> dict[str, float]:
    """Each contender timed ``rounds`` times (default: one whole design) in balanced orders,
    the median of its medians in milliseconds (``_time`` with one input set)."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    orders = balanced_orders(len(names))
    for r in range(rounds or len(orders)):
        for i in orders[r % len(orders)]:
            ms, _ = _time(contenders[names[i]], 1, warmup, runs)
            times[names[i]].append(ms)
    return {n: statistics.median(t) for n, t in times.items()}


def ratio_table(
    title: str,
    key_header: str,
    rows: list[dict],
    key_cells,
    metric: str,
    digits: int = 1,
    first: str = "fadsl",
) -> str:
    """``title``, then a line per row: its key cells, each contender's ``metric`` (``first``
    first, the others in the order first seen), and ``first``'s ratio to each other
    contender ('-' where one was not timed)."""
    seen = list(dict.fromkeys(n for row in rows for n in row[metric]))
    names = sorted(seen, key=lambda n: n != first)  # (stable: first first)
    lines = [
        title,
        key_header + "  ".join(f"{n:>8}" for n in names) + "".join(f"  x{n:>7}" for n in names[1:]),
    ]
    for row in rows:
        t = row[metric]
        lines.append(
            key_cells(row)
            + "  ".join(f"{t[n]:8.{digits}f}" if n in t else f"{'-':>8}" for n in names)
            + "".join(f"  {t[first] / t[n]:8.2f}" if n in t else f"  {'-':>8}" for n in names[1:])
        )
    return "\n".join(lines)


def _pci_bus_id() -> str | None:
    """CUDA device 0's PCI address as NVML spells it (CUDA and NVML may number GPUs apart)."""
    import torch

    props = torch.cuda.get_device_properties(0)
    try:
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return None


def _reference_rows(q, k, v, scale: float, rows: int, dtype, causal: bool = False):
    """Attention for the first ``rows`` queries of batch 0, every head, in ``dtype``."""
    import torch

    qs = q[0, :rows].transpose(0, 1).to(dtype)  # (H, rows, D)
    ks = k[0].transpose(0, 1).to(dtype)
    vs = v[0].transpose(0, 1).to(dtype)
    scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
    if causal:  # bottom-right aligned; seqlen_q == seqlen_k here, so row i sees keys <= i
        keys = torch.arange(ks.shape[1], device=q.device)
        scores = scores.masked_fill(
            keys[None, None, :] > torch.arange(rows, device=q.device)[None, :, None], float("-inf")
        )
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(dtype), vs).transpose(0, 1)


class Operands(NamedTuple):
    """One buffer set of a timed problem: what fadsl's kernels take (``args``, and
    ``keywords``: an 8-bit kernel's descales) and tensors of the same values for the
    references (SDPA, FlashAttention-4): 16-bit, the dequantized values in bf16 if 8-bit."""

    args: tuple
    keywords: dict
    views: tuple

    def values(self) -> tuple:
        """q, k and v as the kernels read them (8-bit: dequantized, in float32)."""
        if not self.keywords:
            return self.args
        return tuple(
            t.float() * self.keywords[f"{n}_descale"][:, None, :, None]
            for n, t in zip("qkv", self.args)
        )


def operands(dtype_name: str, shape: tuple[int, int, int, int], device="cuda") -> Operands:
    """Random q, k and v of ``shape`` (batch, seqlen, heads, head_dim) in ``dtype_name``.
    8-bit: normal values quantized by fadsl.fp8.quantize, a descale per (batch, head)."""
    import torch

    dtype = torch_dtype_of(dtype_name)
    if not Dtype(dtype_name).is_8bit:
        qkv = tuple(torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
        return Operands(qkv, {}, qkv)
    from ..fp8 import quantize

    eight, descales = [], {}
    for name in "qkv":
        x8, descales[f"{name}_descale"] = quantize(torch.randn(shape, device=device), dtype)
        eight.append(x8)
    found = Operands(tuple(eight), descales, ())
    return found._replace(views=tuple(t.to(torch.bfloat16) for t in found.values()))


def fp8_bound(v_max: float, ref_max: float) -> float:
    """research/fp8-forward.md §4's bound on an 8-bit kernel's error: P rounded to e4m3
    (2^-4 of the largest |v| as the kernel reads it, 5 % slack) and O to bf16 (2^-7 of the
    largest output)."""
    return 2**-4 * v_max * 1.05 + 2**-7 * ref_max


def error_bound(dtype_name: str, ops: Operands, v, ref, scale: float, rows: int, causal: bool):
    """The largest error a correct kernel may show on ``ref`` (the float32 reference rows of
    ``ops``, whose v as the kernels read it is ``v``): twice the 16-bit reference's own
    rounding (plus 1e-3); 8-bit, research/fp8-forward.md §4's bound: P rounded to e4m3
    (2^-4 max|v|, 5 % slack) and O to bf16 (2^-7)."""
    if Dtype(dtype_name).is_8bit:
        return fp8_bound(v.abs().max().item(), ref.abs().max().item())
    low = _reference_rows(*ops.args, scale, rows, ops.args[0].dtype, causal).float()
    return 2 * (low - ref).abs().max().item() + 1e-3


def _backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    return {
        name: getattr(SDPBackend, attr) for name, attr in names.items() if hasattr(SDPBackend, attr)
    }


def _flash_attention_4() -> Callable | None:
    """FlashAttention-4's forward (flash_attn.cute, CuTe DSL) where it is installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # not installed, or its compiler library missing: not timed
        return None
    return flash_attn_func


def run(
    kern: FlashAttention,
    seqlens: tuple[int, ...] = DEFAULT_SEQLENS,
    dtype_name: str | None = None,
    causal: bool = False,
    tokens: int = 16384,
    heads: int = DEFAULT_HEADS,
    warmup: int = 32,
    runs: int = 128,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    against: tuple[FlashAttention, ...] = (),
    rounds: int | None = None,
    references: bool = True,
    on_wrong: Callable[[str, str], None] | None = None,
) -> dict:
    """``references``: time SDPA's backends and FlashAttention-4 too (fadsl tune's screening
    rounds leave them out). ``on_wrong``: a contender of ``against`` whose output fails the
    check is reported to it (name, message) and left out of that row instead of stopping the
    run (fadsl tune drops it); ``kern`` itself must always pass."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    cfg = kern.config
    if cfg.window is not None:
        raise ValueError(
            f"spec '{cfg.name}' has a sliding window (mask {cfg.mask_text}): the timing "
            "checks and compares it with references that have none (SDPA's backends, "
            "FlashAttention-4)"
        )
    if causal != (cfg.mask is Mask.CAUSAL):
        raise ValueError(
            "--causal needs a spec with 'mask causal'"
            if causal
            else f"spec '{cfg.name}' is causal: pass --causal so the references mask too"
        )
    dtype_name = dtype_name or cfg.dtypes[0].value
    if dtype_name not in [d.value for d in cfg.dtypes]:
        raise ValueError(
            f"--dtype {dtype_name}: the spec compiles {', '.join(d.value for d in cfg.dtypes)}"
        )
    kernels = variants(kern, against, dtype_name)
    in_bytes = Dtype(dtype_name).nbytes
    d = cfg.head_dim
    scale = 1.0 / math.sqrt(d)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    backends = _backends() if references else {}
    fa4 = _flash_attention_4() if references else None  # None where it is not installed
    read = clocks.nvml_reader(_pci_bus_id())
    sampler = clocks.Sampler(read) if read else None
    rows = []
    for seqlen in seqlens:
        batch = max(1, tokens // seqlen)
        set_bytes = batch * seqlen * heads * d * (3 * in_bytes + 2)  # q, k, v and o
        sets = max(2, min(8, math.ceil(2 * l2 / set_bytes)))
        log(
            f"fadsl bench: seqlen {seqlen}, batch {batch}, heads {heads}, head_dim {d}, {dtype_name}, {sets} buffer sets"
        )
        ops = [operands(dtype_name, (batch, seqlen, heads, d)) for _ in range(sets)]
        qkv = [o.args for o in ops]
        keywords = [o.keywords for o in ops]
        out_dtype = kern.out_torch_dtype if in_bytes == 1 else qkv[0][0].dtype
        outs = [torch.empty(q.shape, device=q.device, dtype=out_dtype) for q, _, _ in qkv]
        row = Row(seqlen, batch, heads, d)
        # Correctness first: 128 query rows of batch 0, every head, against float32 (8-bit:
        # of the dequantized inputs).
        check = min(128, seqlen)
        values = ops[0].values()
        ref = _reference_rows(*values, scale, check, torch.float32, causal)
        row.error_bound = error_bound(dtype_name, ops[0], values[2], ref, scale, check, causal)
        del values
        contenders: dict[str, Callable[[int], object]] = {}
        for name, each in kernels.items():
            out = each(*qkv[0], scale, out=outs[0].fill_(float("nan")), **keywords[0])
            error = (out[0, :check].float() - ref).abs().max().item()
            if not error <= row.error_bound:
                message = (
                    f"seqlen {seqlen}: {name}'s max error {error:.3e} exceeds "
                    f"{row.error_bound:.3e}; not timing a wrong kernel"
                )
                if on_wrong is None or each is kern:
                    raise RuntimeError(message)
                on_wrong(name, message)
                continue
            row.max_error = max(row.max_error, error)
            contenders[name] = lambda i, qkv=qkv, outs=outs, each=each, kw=keywords: each(
                *qkv[i], scale, out=outs[i], **kw[i]
            )
        for name, backend in backends.items():
            views = [[t.transpose(1, 2) for t in o.views] for o in ops]

            def call(i, backend=backend, views=views):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*views[i], scale=scale, is_causal=causal)

            try:
                call(0)
            except RuntimeError as err:
                log(f"fadsl bench: {name} backend unavailable here: {str(err).splitlines()[0]}")
                continue
            contenders[name] = call
        if fa4 is not None:

            def call_fa4(i, fa4=fa4, ops=ops):
                result = fa4(*ops[i].views, softmax_scale=scale, causal=causal)
                return result[0] if isinstance(result, tuple) else result

            try:
                error = (call_fa4(0)[0, :check].float() - ref).abs().max().item()
            except Exception as err:  # its JIT or its checks: report, time the rest
                log(f"fadsl bench: FlashAttention-4 failed here: {str(err).splitlines()[0]}")
            else:
                if error <= row.error_bound:
                    contenders["fa4"] = call_fa4
                else:
                    log(f"fadsl bench: FlashAttention-4's max error {error:.3e}: not timed")
        total = flops(batch, heads, seqlen, seqlen, d, causal)
        medians: dict[str, list[float]] = {name: [] for name in contenders}
        readings: dict[str, list[clocks.Reading]] = {name: [] for name in contenders}
        names = list(contenders)
        orders = balanced_orders(len(names))
        row.rounds = rounds or len(orders)
        row.balanced = row.rounds % len(orders) == 0
        if not row.balanced:
            log(
                f"fadsl bench: {row.rounds} rounds are not whole designs of {len(orders)} for "
                f"{len(names)} contenders: some come first, or after another, more often"
            )
        for r in range(row.rounds):  # the design's rows in turn, cycling
            for name in (names[i] for i in orders[r % len(orders)]):
                ms, sampled = _time(contenders[name], sets, warmup, runs, sampler)
                medians[name].append(ms)
                readings[name] += sampled
        for name, times in medians.items():
            row.ms[name] = statistics.median(times)
            row.tflops[name] = total / (row.ms[name] * 1e-3) / 1e12
            summary = clocks.summarize(readings[name])
            if summary:
                row.clocks[name] = asdict(summary)
        rows.append(row)
        del ops, qkv, outs
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    return {
        "spec": kern.compiled.file,
        "spec_hash": spec_hash(kern.compiled.kernel),
        "kernel": cfg.name,
        "dtype": dtype_name,
        "causal": causal,
        "device": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "against": [
            {"spec": k.compiled.file, "spec_hash": spec_hash(k.compiled.kernel), "kernel": name}
            for name, k in kernels.items()
            if k is not kern
        ],
        "method": {
            "tokens": tokens,
            "heads": heads,
            "warmup": warmup,
            "runs": runs,
            "rounds": rounds,  # None: one whole design per row (each row says how many)
            "order": "the rows of a balanced (Williams) design, cycling",
            "statistic": "median" if rounds == 1 else "median of the rounds' medians",
        },
        "resources": kern.resources(dtype_name),
        "clocks": "nvml" if sampler else "unavailable",
        "rows": [asdict(r) for r in rows],
    }


def variants(
    kern: FlashAttention, against: tuple[FlashAttention, ...], dtype_name: str
) -> dict[str, FlashAttention]:
    """The fadsl contenders by name: the kernel ("fadsl"), then each of ``against``
    ("fadsl:<kernel>"), which must have its head_dim and mask and compile ``dtype_name``."""
    cfg = kern.config
    out = {"fadsl": kern}
    for other in against:
        oc = other.config
        if (oc.head_dim, oc.mask, oc.window) != (cfg.head_dim, cfg.mask, cfg.window):
            raise ValueError(
                f"--against {other.compiled.file}: head_dim {oc.head_dim}, mask "
                f"{oc.mask_text}; the spec's are head_dim {cfg.head_dim}, mask {cfg.mask_text}"
            )
        if dtype_name not in [d.value for d in oc.dtypes]:
            raise ValueError(f"--against {other.compiled.file}: does not compile {dtype_name}")
        if oc.out_dtype != cfg.out_dtype:
            raise ValueError(
                f"--against {other.compiled.file}: writes O in {oc.out_dtype.value}; the "
                f"spec's O is {cfg.out_dtype.value}"
            )
        name = f"fadsl:{oc.name}"
        while name in out:
            name += "'"
        out[name] = other
    return out


def clock_lines(result: dict) -> list[str]:
    """Per row, each contender's median SM clock, mean power and share of samples at the
    power cap while it was timed (rows without clocks: nothing)."""
    lines = []
    for row in result["rows"]:
        sampled = row.get("clocks") or {}
        if sampled:
            parts = [
                f"{name} {clocks.ClockSummary(**summary).text()}"
                for name, summary in sampled.items()
            ]
            lines.append(f"{row['seqlen']:>7} clocks: " + ", ".join(parts))
    return lines


def table(result: dict) -> str:
    names = list(result["rows"][0]["tflops"]) if result["rows"] else ["fadsl"]
    ours = [n for n in names if n.split(":")[0] == "fadsl"]
    refs = [n for n in names if n not in ours]
    ratios = [(a, r) for a in ours for r in refs] + [(a, "fadsl") for a in ours[1:]]
    head = f"{'seqlen':>7} {'batch':>5} " + " ".join(f"{n + ' TF/s':>12}" for n in names)
    head += "".join(f" {a + '/' + r:>12}" for a, r in ratios)
    lines = [head]
    for row in result["rows"]:
        tf = row["tflops"]
        line = f"{row['seqlen']:>7} {row['batch']:>5} " + " ".join(
            f"{tf.get(n, float('nan')):>12.1f}" for n in names
        )
        line += "".join(f" {tf[a] / tf[r]:>12.2f}" for a, r in ratios if a in tf and r in tf)
        lines.append(line)
    lines += clock_lines(result)
    res = result.get("resources") or {}
    if res:
        lines.append(
            f"resources: {res.get('registers')} registers/thread, {res.get('smem_bytes')} B SMEM/CTA, "
            f"{res.get('local_bytes')} B local (spills), {res.get('ctas_per_sm')} CTAs/SM"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    seqlens = [r["seqlen"] for r in result["rows"]]
    for name in result["rows"][0]["tflops"]:
        ax.plot(seqlens, [r["tflops"].get(name) for r in result["rows"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [str(s) for s in seqlens])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"{result['kernel']} {result['dtype']} on {result['device']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=2) + "\n")
