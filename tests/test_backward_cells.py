"""scripts/backward_cells.py on the CPU: issue 44's table from bwd_vs_fa4.py's --json files
(the timings themselves run on the GPU machine, `scripts/device.sh bwdcells`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "backward_cells.py"
_SPEC = importlib.util.spec_from_file_location("backward_cells", _SCRIPT)
bc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bc)


def _cell(tmp_path: Path, spec: str, seqlen: int, **tflops: float) -> Path:
    """A file as bwd_vs_fa4.py --json writes it (its shape, each contender's summary)."""
    path = tmp_path / f"{Path(spec).stem}_{seqlen}.json"
    summary = {who: dict(tflops=tf, mhz=1500.0, runs=[]) for who, tf in tflops.items()}
    shape = dict(spec=spec, seqlen=seqlen, batch=16384 // seqlen, heads=16, head_dim=128)
    path.write_text(json.dumps(dict(shape=shape, summary=summary)))
    return path


def test_a_row_per_spec_with_its_lengths_in_order_and_the_ratios(tmp_path):
    files = [
        _cell(tmp_path, "examples/fa3_hopper.fa", 16384, fadsl=600.0, cudnn=500.0, fa4=400.0),
        _cell(tmp_path, "examples/fa3_hopper.fa", 1024, fadsl=420.0, cudnn=400.0, fa4=430.0),
        _cell(tmp_path, "examples/fa3_causal.fa", 4096, fadsl=490.0, cudnn=420.0, fa4=490.0),
    ]
    lines = bc.table(bc.read_cells(files)).splitlines()
    assert lines[0].startswith("| spec | seqlen | fadsl")
    assert len(lines) == 4  # header, rule, two specs
    hopper = lines[2].split(" | ")
    assert hopper[0] == "| fa3_hopper" and hopper[1] == "1k / 16k"
    assert hopper[2:5] == ["420.0 / 600.0", "400.0 / 500.0", "430.0 / 400.0"]
    assert hopper[5] == "1.05 / 1.20" and hopper[6] == "0.98 / 1.50 |"
    assert lines[3].startswith("| fa3_causal | 4k | 490.0 | 420.0 | 490.0 | 1.17 | 1.00 |")


def test_a_contender_that_did_not_run_reads_a_dash(tmp_path):
    files = [
        _cell(tmp_path, "examples/fa3_hdim64.fa", 1024, fadsl=400.0, cudnn=320.0),
        _cell(tmp_path, "examples/fa3_hdim64.fa", 4096, fadsl=500.0, cudnn=400.0, fa4=490.0),
    ]
    row = bc.table(bc.read_cells(files)).splitlines()[2].split(" | ")
    assert row[4] == "- / 490.0"  # FA4 was not staged for the first cell
    assert row[6] == "- / 1.02 |"


def test_without_files_it_prints_its_usage_and_fails():
    done = subprocess.run([sys.executable, str(_SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 2 and "Usage" in done.stderr
