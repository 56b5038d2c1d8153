"""Render a compiled kernel to CUDA through the jinja2 templates in emit/.

Templates hold structure and slots; this module computes everything else:
names, byte offsets, the ordered steps and syncs, and the comments that say
which hazards each sync orders.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2

from . import __version__
from .ir import Dtype, Kernel, Step, Sync, SyncKind
from .pipeline import Compiled
from .printer import format_kernel

TEMPLATE = "kernel_sm80.cu.j2"
# The CUDA headers a generated source includes, relative to emit/include (where they ship)
# and to the folder they are written to next to it.
HEADERS = ("fadsl/sm80_ptx.cuh", "fadsl/sm80.cuh")


@dataclass(frozen=True)
class Source:
    """One rendered translation unit: the kernel for one dtype."""

    kernel_name: str
    dtype: Dtype
    filename: str
    text: str


@functools.cache
def _environment() -> jinja2.Environment:
    root = resources.files("fadsl.emit")
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: root.joinpath(name).read_text()),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def header_text() -> str:
    """The headers' text, all of it (for cache keys)."""
    return "".join(_header(name) for name in HEADERS)


def _header(name: str) -> str:
    return resources.files("fadsl.emit").joinpath("include", name).read_text()


def write_headers(root: Path) -> list[Path]:
    """Write the headers under ``root`` (``root/fadsl/...``), where ``-I root`` finds them."""
    paths = []
    for name in HEADERS:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_header(name))
        paths.append(path)
    return paths


def spec_hash(kernel: Kernel) -> str:
    """A hash of the normalised spec: the final IR printed without source locations."""
    return hashlib.sha256(format_kernel(kernel).encode()).hexdigest()[:16]


def _sync_comment(sync: Sync) -> str:
    if sync.kind is SyncKind.CP_ASYNC_WAIT:
        landed = "all" if sync.groups == 0 else f"all but the newest {sync.groups}"
        head = f"cp.async.wait_group {sync.groups}: {landed} of this thread's copy groups have landed; completes:"
    elif sync.kind is SyncKind.SYNCWARP:
        head = "warp barrier; orders:"
    else:
        head = "CTA barrier; orders:"
    return "\n".join([head] + [f"  {h.describe()}" for h in sync.serves])


def _item(item: Step | Sync) -> dict[str, Any]:
    match item:
        case Step():
            return {"kind": "step", "op": item.op, "comment": item.title}
        case Sync(kind=SyncKind.CP_ASYNC_WAIT):
            return {"kind": "wait", "groups": item.groups, "comment": _sync_comment(item)}
        case Sync(kind=SyncKind.SYNCWARP):
            return {"kind": "sync", "sync": "syncwarp", "comment": _sync_comment(item)}
        case Sync(kind=SyncKind.SYNCTHREADS):
            return {"kind": "sync", "sync": "syncthreads", "comment": _sync_comment(item)}
        case _:
            raise AssertionError(f"cannot render {item!r}")


def context(compiled: Compiled, dtype: Dtype) -> dict[str, Any]:
    kernel = compiled.kernel
    cfg = kernel.config
    assert kernel.smem_bytes is not None, "render a kernel only after plan_smem"
    buffers = {}
    for buf in kernel.buffers:
        swz = buf.swizzle
        buffers[buf.name] = {
            "offset": buf.offset,
            "rows": buf.rows,
            "cols": buf.cols,
            "swizzle": None if swz is None else [swz.bits, swz.base, swz.shift],
        }
    return {
        "spec_name": compiled.file,
        "spec_hash": spec_hash(kernel),
        "fadsl_version": __version__,
        "kernel_name": f"{cfg.name}_{dtype.value}",
        "dtype": dtype.value,
        "head_dim": cfg.head_dim,
        "block_r": cfg.block_r,
        "block_c": cfg.block_c,
        "warps": cfg.warps,
        "mask": cfg.mask.value,
        "smem_bytes": kernel.smem_bytes,
        "buffers": buffers,
        "reg_load": {t.role.value: t.reg_load.value for t in kernel.tensors},
        "phases": [
            {"name": phase.value, "items": [_item(i) for i in items]}
            for phase, items in kernel.phases()
        ],
    }


def render(compiled: Compiled) -> tuple[Source, ...]:
    """One self-contained .cu per dtype of the spec."""
    template = _environment().get_template(TEMPLATE)
    sources = []
    for dtype in compiled.kernel.config.dtypes:
        ctx = context(compiled, dtype)
        text = template.render(**ctx)
        name = ctx["kernel_name"]
        sources.append(Source(name, dtype, f"{name}.cu", text))
    return tuple(sources)


def write(compiled: Compiled, out_dir: Path) -> list[Path]:
    """Write the .cu files and the helper headers they include into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = write_headers(out_dir)
    for source in render(compiled):
        path = out_dir / source.filename
        path.write_text(source.text)
        paths.append(path)
    return paths
