"""The tile timeline (fadsl/sm90_trace.cuh, fadsl/tools/tiletrace.py, scripts/tile_trace.py): its
summary from hand-made stamps, and a traced build that compiles and stamps %globaltimer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fadsl import targets
from fadsl.tools import tiletrace
from fadsl.build.nvrtc import compile_cubin, nvrtc_available

ROOT = Path(__file__).resolve().parents[1]
SMALL = tiletrace.TraceLayout(ctas=2, warpgroups=3, steps=4, marks=8)


def _trace(stamps: dict[tuple[int, int, int], list[int]]) -> list[int]:
    flat = [0] * (SMALL.ctas * SMALL.warpgroups * SMALL.steps * SMALL.marks)
    for (cta, wg, step), marks in stamps.items():
        at = ((cta * SMALL.warpgroups + wg) * SMALL.steps + step) * SMALL.marks
        flat[at : at + SMALL.marks] = marks
    return flat


def test_the_layout_is_the_headers_and_unpacks_its_bytes():
    layout = tiletrace.TraceLayout.of_target(targets.get("sm_90a"))
    assert layout == tiletrace.TraceLayout(ctas=160, warpgroups=3, steps=128, marks=8)
    raw = bytes(8 * layout.ctas * layout.warpgroups * layout.steps * layout.marks)
    stamps = layout.unpack(raw[:8] + (7).to_bytes(8, "little") + raw[16:])
    assert stamps[:3] == [0, 7, 0] and len(stamps) == len(raw) // 8


def test_phases_are_medians_over_stamped_tiles_and_gaps_between_a_warpgroups_tiles():
    trace = _trace(
        {
            # cta 0, wg 0: two tiles back to back, 100 ns apart
            (0, 0, 0): [1000, 1100, 1300, 4300, 4350, 4500, 4800, 4900],
            (0, 0, 1): [5000, 5100, 5200, 8200, 8250, 8500, 8700, 8800],
            # cta 1, wg 2: one tile, then one missing its store mark (not counted as a tile;
            # its start still ends the first one's gap)
            (1, 2, 0): [2000, 2100, 2400, 5400, 5450, 5600, 5900, 6100],
            (1, 2, 1): [6500, 6600, 6700, 9000, 9050, 9100, 0, 0],
        }
    )
    timeline = tiletrace.phases(trace, SMALL)
    assert timeline.tiles == 3
    assert timeline.phases == {
        "Q, K, turn": 100,
        "first softmax": 200,
        "mainloop": 3000,
        "last turn": 50,
        "last P V": 150,
        "O to SMEM": 300,
        "store issue": 100,
    }
    assert timeline.gap == 250  # the median of 100 (cta 0) and 400 (cta 1)
    assert timeline.tile == 3900
    assert timeline.per_block(11) == 300  # 3000 ns over blocks 1 .. 10
    lines = tiletrace.report(timeline, 11).splitlines()
    assert lines[0] == "3 tiles of 11 K/V blocks; a mainloop block takes 0.30 us"
    assert lines[2].split() == ["Q,", "K,", "turn", "0.10", "0.33"]
    assert lines[3].split() == ["first", "softmax", "0.20", "0.67"]
    assert lines[-2].split()[-2:] == ["0.25", "0.83"]  # the gap
    # beyond its 11 blocks a tile costs 3900 + 250 - 11 * 300 = 850 ns, 2.83 blocks
    assert lines[-1].split()[5:7] == ["0.85", "2.83"]


def test_no_complete_tile_gives_none():
    assert tiletrace.phases(_trace({(0, 1, 0): [1, 2, 3, 4, 5, 6, 7, 0]}), SMALL) is None


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (cuda-bindings)")
def test_a_traced_build_stamps_the_globaltimer_and_a_plain_one_does_not(tmp_path):
    import fadsl
    from fadsl.tools import sass
    from fadsl.ir import Dtype

    kern = fadsl.load(str(ROOT / "examples" / "fa3_hdim64.fa"), verbose=False)
    request = kern.request(Dtype.BF16, "sm_90a")
    marks = [int(m) for m in re.findall(r"FADSL_TILE_MARK\(step, (\d+)\)", request.text)]
    assert marks == list(
        range(tiletrace.TraceLayout.of_target(targets.get("sm_90a")).marks)
    )  # each once, in order
    traced = compile_cubin(
        "#define FADSL_TILE_TRACE 1\n" + request.text,
        request.filename,
        request.kernel,
        "sm_90a",
        tmp_path,
    )
    assert b"fadsl_tile_trace" in traced.cubin
    assert b"fadsl_tile_trace" not in kern.cubin(Dtype.BF16, "sm_90a").cubin
    tool = sass.nvdisasm()
    if tool:
        assert sass.disassemble(traced.cubin, tool).count("SR_GLOBALTIMER") >= 5
