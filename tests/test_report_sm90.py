"""`fadsl check` and `fadsl explain` on sm_90a: roles, rings, named barriers, the register
cap from setmaxnreg and the schedule per role, read off the kernel's IR."""

import json

import pytest

from conftest import ROOT
from fadsl.cli import main
from fadsl.build.spill_check import KernelUsage, RegisterCheck, Usage
from fadsl.ir import Dtype
from fadsl.pipeline import compile_file, compile_source
from fadsl.tools.report import explain_data, explain_text, summary
from fadsl.targets.sm90.plan_smem import o_over_rings
from fadsl.targets.sm90.verify import block_counts

# FlashAttention-3's 128 x 176 (O over the dead V ring): the reports' richest sm_90a case
HOPPER = "tests/specs/bench/fa3_hopper_bc176.fa"
ONE_WG = "tests/specs/sm90/fa3_one_wg.fa"


def run(capsys, monkeypatch, *args) -> str:
    monkeypatch.chdir(ROOT)
    assert main([*args, "--no-compile"]) == 0
    return capsys.readouterr().out


def test_check_shows_roles_not_sm80_lines(capsys, monkeypatch):
    out = run(capsys, monkeypatch, "check", HOPPER)
    lines = out.splitlines()
    assert "  warps     12 (384 threads: 3 warpgroups)" in lines
    assert (
        "  producer  warpgroup 0, setmaxnreg.dec 24; one elected thread issues every TMA load"
        in lines
    )
    assert "  consumers warpgroups 1..2, setmaxnreg.inc 240; 64 query rows each" in lines
    assert "  swizzle   128B (TMA writes it, wgmma reads it)" in lines
    assert "  stages    2 (K and V rings of 2 slots, mbarrier pipeline)" in lines
    assert "  schedule  pingpong on, overlap on, scheduler persistent, rescale lazy" in lines
    assert "query rows per warp" not in out
    assert not any(line.startswith("  mainloop") for line in lines)
    assert "11 mbarriers; O over the dead V ring" in out


def test_register_cap_is_the_consumers_setmaxnreg():
    compiled = compile_file(HOPPER)
    check = RegisterCheck(
        (KernelUsage(Dtype.BF16, "sm_90a", Usage(registers=168)),), "test compiler"
    )
    line = next(x for x in summary(compiled, check).splitlines() if "registers" in x)
    assert line.startswith("  registers bf16: 168 sm_90a (cap 240, the consumers' setmaxnreg")
    assert "launch allocation before setmaxnreg: 384 threads x 168, the CTA's pool" in line
    data = explain_data(compiled, check)
    assert data["register_cap"] == 240
    assert "at most 240 registers per thread, the consumers' setmaxnreg" in explain_text(
        compiled, check
    )


def test_register_cap_follows_the_spec():
    source = (ROOT / HOPPER).read_text().replace("consumers = 240", "consumers = 232")
    compiled = compile_source(source, "fa3_232.fa")
    assert explain_data(compiled)["register_cap"] == 232
    assert "setmaxnreg.inc 232" in summary(compiled)


def test_explain_smem_columns_line_up(capsys, monkeypatch):
    out = run(capsys, monkeypatch, "explain", HOPPER).splitlines()
    start = out.index("SMEM map")
    header, rows = out[start + 1], out[start + 2 : start + 6]
    for name in ("scope", "live", "shares with"):
        column = header.index(name)
        for row in rows:
            assert row[column - 1] == " " and row[column] != " ", (name, row)
    assert "  Q            0  32768       0  warpgroup q_g2s..convert_p -" in rows


def test_explain_shows_roles_rings_and_barriers(capsys, monkeypatch):
    out = run(capsys, monkeypatch, "explain", HOPPER)
    for line in [
        "Warp specialisation (12 warps = 3 warpgroups of 128 threads)",
        "  consumers  warpgroups 1..2, setmaxnreg.inc to 240 registers: 64 query rows each "
        "(B_r = 128)",
        "  registers  128 x 24 + 256 x 240 = 64512 of the CTA's launch allocation, 64512",
        "  pingpong   on: the consumer warpgroups take turns issuing wgmma (named barrier 'turn')",
        "  overlap    on: S(j+1) = Q K^T is in flight during softmax(j)",
        "TMA tiles and their mbarriers (11 mbarriers, 88 bytes at offset 212992, after the rings)",
        "  Q  one tile of 32768 bytes at offset 0, per CTA tile t (phase t & 1):",
        "       q_full   1 arrival + 32768 transaction bytes (mbarrier.arrive.expect_tx by "
        "producer_thread); waited by consumers at parity tile",
        "       q_empty  8 arrivals (mbarrier.arrive by consumer_warp_lane0); waited by "
        "producer_thread at parity tile^1",
        "       o_free   2 arrivals (mbarrier.arrive by consumer_elected); waited by "
        "producer_thread at parity tile^1",
        "  K  ring of 2 slots x 45056 bytes at offset 32768; block i in slot i % 2, "
        "phase (i / 2) & 1; per slot:",
        "       v_empty  8 arrivals (mbarrier.arrive by consumer_warp_lane0); waited by "
        "producer_thread at parity phase^1",
        "  turn       ids 5..6  256 threads",
        "  o_store    ids 2..3  128 threads",
        "  ring_dead  id 1      256 threads",
        "Verified: fadsl/targets/sm90/verify.py proves this plan (every hazard ordered, no wait "
        "left hanging) over the async model for a CTA running 1-3 tiles in turn, each of 1..4 "
        "K/V blocks (up to stages + 2; empty tiles touch no SMEM)",
        "  producer program (warpgroup 0; TMA loads by its elected thread)",
        "  consumer program (each consumer warpgroup, on its 64 query rows)",
    ]:
        assert line in out.splitlines(), line
    producer = out[out.index("  producer program") : out.index("  consumer program")]
    consumer = out[out.index("  consumer program") :]
    assert "k_g2s" in producer and "qk  " not in producer and "by consumers" not in producer
    assert "by producer_thread" not in consumer and "      qk         S = Q K^T" in consumer
    assert "why: ping-pong: hand the tensor cores to the next warpgroup" in consumer


def test_explain_json_splits_the_schedule_by_role(capsys, monkeypatch):
    data = json.loads(run(capsys, monkeypatch, "explain", HOPPER, "--json"))
    roles = {r["role"]: r for r in data["warp_specialisation"]["roles"]}
    assert roles["producer"]["setmaxnreg"] == 24 and roles["consumers"]["warpgroups"] == [1, 2]
    tiles = {t["buffer"]: t for t in data["tma_tiles"]}
    assert tiles["Q"]["ring"] is False and tiles["K"]["slots"] == 2
    bars = {b["mbarrier"]: b for t in data["tma_tiles"] for b in t["mbarriers"]}
    assert bars["k_empty"]["arrivals"] == 8 and bars["k_full"]["tx_bytes"] == 176 * 128 * 2
    assert bars["q_full"]["parity"] == ["tile"] and bars["q_empty"]["parity"] == ["tile^1"]
    assert data["verified"]["block_counts"] == [1, 4]
    assert data["verified"]["tiles"] == [1, 3]
    # every item of the phase-ordered schedule sits in exactly one role's program
    everything = [i for p in data["schedule"] for i in p["items"]]
    per_role = [i for prog in data["programs"] for p in prog["phases"] for i in p["items"]]
    assert len(everything) == len(per_role)
    assert _keyed(everything) == _keyed(per_role)


def _keyed(items: list[dict]) -> list[str]:
    """Schedule entries as comparable text (the per-role ones carry more fields)."""
    return sorted(
        json.dumps({k: i[k] for k in i if k in ("step", "what", "sync", "serves")}) for i in items
    )


@pytest.mark.parametrize("stages", [1, 3])
def test_rings_and_verified_counts_follow_stages(stages):
    source = (ROOT / "tests/specs/bench/fa3_hopper_cluster_off.fa").read_text()  # O may alias
    source = source.replace("stages     2", f"stages     {stages}")
    compiled = compile_source(source, f"fa3_s{stages}.fa")
    data = explain_data(compiled)
    # 3 stages of 128 x 128 leave no room for O's own bytes: O over the V ring, with its
    # free barrier (the next tile's V loads wait for its store)
    aliased = o_over_rings(compiled.kernel)
    assert aliased == (stages == 3)
    assert {t["buffer"]: t["slots"] for t in data["tma_tiles"]} == {
        "Q": 1,
        "K": stages,
        "V": stages,
        **({"O": 1} if aliased else {}),
    }
    assert data["mbarrier_array"]["count"] == 2 + 4 * stages + aliased
    assert data["verified"]["block_counts"] == [1, stages + 2]
    assert block_counts(compiled.kernel) == range(1, stages + 3)


def test_one_consumer_causal_without_pingpong(capsys, monkeypatch):
    out = run(capsys, monkeypatch, "explain", ONE_WG)
    assert "  consumers  warpgroup 1, setmaxnreg.inc to 256 registers" in out
    # causal: a Q block above every key is an empty tile, which touches no SMEM
    assert "1-3 tiles in turn, each of 1..5 K/V blocks" in out
    assert "bar=turn" not in out and "  turn " not in out and "pingpong   off" in out
    assert "  o_store    id 2      128 threads" in out


def test_explain_shows_the_q_ring_of_tiles(capsys, monkeypatch):
    """q_slots 2: Q and its barriers a ring of two tiles, in the text and the JSON; the
    proof covers runs of five tiles (each Q slot's third use)."""
    spec = "tests/specs/sm90/fa3_q_ring.fa"
    data = json.loads(run(capsys, monkeypatch, "explain", spec, "--json"))
    assert data["warp_specialisation"]["q_slots"] == 2
    q = next(t for t in data["tma_tiles"] if t["buffer"] == "Q")
    assert q["ring"] is False and q["slots"] == 2 and q["slot_bytes"] == 192 * 64 * 2
    assert all(b["per_slot"] for b in q["mbarriers"])
    assert data["mbarrier_array"]["count"] == 2 * 2 + 4 * 2
    assert data["verified"]["tiles"] == [1, 5]
    text = run(capsys, monkeypatch, "explain", spec)
    assert "  Q  ring of 2 tiles x 24576 bytes at offset 0; CTA tile t in slot t % 2" in text
    assert "  q_slots    2: Q in a ring of 2 tiles" in text
    assert "bar=q_full[t%2] parity=tile" in text
    check = run(capsys, monkeypatch, "check", spec)
    assert "  q_slots   2 (Q in a ring of 2 tiles)" in check.splitlines()
