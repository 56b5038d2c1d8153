"""Training variants of the examples as spec text: ``training_spec("fa3_causal+deterministic")``,
the names tests/test_gpu_backward.py, the CPU build tests, scripts/prebuild.py, scripts/device.sh
and research/probes/backward_ab.py take (no torch or GPU needed)."""

from __future__ import annotations

import re
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STAGED_DQ = "dQ: rf -st.shared-> smem[warpgroup] -reduce.add-> gmem"


def training_spec(name: str) -> str:
    """An example's spec text for training: ``NAME`` is the example (examples/NAME.fa, else
    examples/modifiers/NAME.fa) with its own backward block (or ``backward {}`` added where it
    has none); ``NAME+KEY`` / ``NAME-KEY`` (repeatable)
    turns an on/off key of the block on / off (``fa3_causal-overlap+deterministic``);
    ``+br128`` / ``+br64`` / ``+br80`` sets the block's tile to B_r = 128 / 64 / 80 (B_c 128;
    at 80 dS goes ``rf -stmatrix-> smem``); ``+bc64`` sets head_dim 256's tile to B_r = 64,
    B_c = 64; ``+s2`` / ``+s3`` sets the stages; ``+dqred`` / ``-dqred`` gives dQ the path
    ``rf -red.add-> gmem`` / the staged one; ``+ds_stmatrix`` / ``-ds_stmatrix`` gives dS
    the path ``rf -stmatrix-> smem[cta] -wgmma-> rf`` / the st.shared one (not at B_r 80);
    ``+dkv_tma`` / ``-dkv_tma`` gives dK and dV the path ``rf -stmatrix-> smem[warpgroup]
    -tma-> gmem`` / ``rf -st.global-> gmem`` (the first is refused, and so dropped, where
    ``dq_lag`` ends up off or ``scheduler persistent`` on, unless the name says ``+dkv_tma``);
    ``+p32`` sets setmaxnreg to producer 32, consumers 232; ``+chainsN`` (N 1 to 4) sets
    ``dq_chains N``; ``+persistent`` / ``-persistent``
    sets the block's ``scheduler persistent`` / ``grid``; ``+dq_writer`` turns the writer
    warps on as any other key. An example whose block says ``scheduler persistent`` gets
    ``scheduler grid`` with ``+deterministic`` or ``+dq_writer`` (which persistent refuses)
    unless the name says ``+persistent`` itself; likewise a block that says ``dq_lag on`` gets
    ``dq_lag off`` where a switch asks for what it refuses (``+early_dv``,
    ``+dv_before_meeting``, ``+deterministic``, ``+dq_writer``, ``-overlap``, ``-dqred``, or
    ``+br64`` at head_dim 64, where dQ is split by keys) unless the name says ``+dq_lag``,
    and ``dq_first off`` wherever ``dq_lag`` ends up off; ``peel_dead on`` (fa3_causal's) ends
    up off where ``dq_lag`` does, with ``scheduler persistent`` or at B_r 80, unless the name
    says ``+peel_dead``; ``late_v on`` (fa3_causal's) ends up off where ``dq_lag`` does or
    with ``scheduler persistent``, unless the name says ``+late_v``."""
    example, *switches = re.split(r"(?=[+-])", name)
    path = EXAMPLES / f"{example}.fa"
    text = (path if path.is_file() else EXAMPLES / "modifiers" / f"{example}.fa").read_text()
    if "backward {" not in text:
        body, close = text.rstrip().rsplit("}", 1)
        text = f"{body}  backward {{\n  }}\n}}{close}\n"
    head, block = text.split("backward {", 1)
    for switch in switches:
        if switch[1:] in ("br64", "br128", "br80"):
            block = _set_line(block, "tile", f"tile B_r = {switch[3:]}, B_c = 128")
            ds_store = "stmatrix" if switch[1:] == "br80" else "st.shared"
            block = _set_line(block, "dS:", f"dS: rf -{ds_store}-> smem[cta] -wgmma-> rf")
        elif switch[1:] == "bc64":
            block = _set_line(block, "tile", "tile B_r = 64, B_c = 64")
        elif switch[1:] in ("s2", "s3"):
            block = _set_line(block, "stages", f"stages {switch[2:]}")
        elif re.fullmatch(r"\+chains[1-4]", switch):
            block = _set_line(block, "dq_chains", f"dq_chains {switch[7:]}")
        elif switch[1:] == "p32":
            block = _set_line(block, "registers", "registers producer = 32, consumers = 232")
        elif switch[1:] == "ds_stmatrix":  # (after a +brNN, which sets dS's line too)
            ds_store = "stmatrix" if switch[0] == "+" else "st.shared"
            block = _set_line(block, "dS:", f"dS: rf -{ds_store}-> smem[cta] -wgmma-> rf")
        elif switch[1:] == "persistent":  # the backward's scheduler (the forward's own stays)
            block = _set_line(
                block, "scheduler", f"scheduler {'persistent' if switch[0] == '+' else 'grid'}"
            )
        elif switch[1:] == "dkv_tma":
            path = TMA_DKV if switch[0] == "+" else "rf -st.global-> gmem"
            for grad in ("dK:", "dV:"):
                block = _set_line(block, grad, f"{grad} {path}")
        elif switch[1:] == "dqred":
            block = _set_line(
                block, "dQ:", "dQ: rf -red.add-> gmem" if switch[0] == "+" else STAGED_DQ
            )
        else:
            key, value = switch[1:], "on" if switch[0] == "+" else "off"
            block = _set_line(block, key, f"{key} {value}")
    refused = re.search(r"^\s*(deterministic|dq_writer)\s+on\b", block, re.M)
    if refused and "+persistent" not in switches:
        block = re.sub(r"^(\s*)scheduler\s+persistent\b", r"\1scheduler grid", block, flags=re.M)
    by_keys = "+br64" in switches and re.search(r"^\s*head_dim\s+64\b", head, re.M)
    lag_refused = set(switches) & {"+early_dv", "+dv_before_meeting", "+deterministic"}
    lag_refused |= set(switches) & {"+dq_writer", "-overlap", "-dqred"}
    if (lag_refused or by_keys) and "+dq_lag" not in switches:
        block = re.sub(r"^(\s*)dq_lag\s+on\b", r"\1dq_lag off", block, flags=re.M)
    if not re.search(r"^\s*dq_lag\s+on\b", block, re.M):  # (`dq_first` orders the lag)
        block = re.sub(r"^(\s*)dq_first\s+on\b", r"\1dq_first off", block, flags=re.M)
    # dK and dV by TMA: the lagged consumer's, one tile per CTA
    persistent = re.search(r"^\s*scheduler\s+persistent\b", block, re.M)
    if (persistent or not re.search(r"^\s*dq_lag\s+on\b", block, re.M)) and (
        "+dkv_tma" not in switches
    ):
        block = block.replace(TMA_DKV, "rf -st.global-> gmem")
    # `peel_dead on`: the lagged consumer's, one tile per CTA, dS^T's rows keys (not B_r 80)
    br80 = re.search(r"^\s*tile\s+B_r\s*=\s*80\b", block, re.M)
    if (persistent or br80 or not re.search(r"^\s*dq_lag\s+on\b", block, re.M)) and (
        "+peel_dead" not in switches
    ):
        block = re.sub(r"^(\s*)peel_dead\s+on\b", r"\1peel_dead off", block, flags=re.M)
    # `late_v on`: the lagged consumer's, one tile per CTA
    if (persistent or not re.search(r"^\s*dq_lag\s+on\b", block, re.M)) and (
        "+late_v" not in switches
    ):
        block = re.sub(r"^(\s*)late_v\s+on\b", r"\1late_v off", block, flags=re.M)
    return head + "backward {" + block


TMA_DKV = "rf -stmatrix-> smem[warpgroup] -tma-> gmem"  # dK's and dV's path by TMA


def _set_line(block: str, first_word: str, line: str) -> str:
    """The block with its first line that starts with ``first_word`` replaced by ``line``, or
    ``line`` added at its top."""
    found = re.compile(rf"^(\s*){re.escape(first_word)}(\s|$).*$", re.M)
    if found.search(block):
        return found.sub(lambda m: m[1] + line, block, count=1)
    return f"\n    {line}" + block
