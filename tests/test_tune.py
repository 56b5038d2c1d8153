"""fadsl tune on the CPU: the variants (rewritten settings, pruning, repairs), the search with
an injected timer and compile job (winner, cache, budget), the compile pool with NVRTC, the
error without a GPU and the command line's argument errors. The timing itself needs a GPU:
its method is bench's (tests/test_bench_orders.py, tests/test_gpu_*.py)."""

from __future__ import annotations

import io
import re
from dataclasses import replace
from pathlib import Path

import pytest

import fadsl
from conftest import ROOT
from fadsl.cli import main
from fadsl.errors import SpecError
from fadsl.ir import Mask, Rescale
from fadsl.pipeline import compile_source, front_end
from fadsl.targets import get
from fadsl.tools import tune as tuning
from fadsl.tools.tune_starts import shipped_starts
from fadsl.tools.tune_build import OK, SPILLS, BuildJob, Built, build_variant
from fadsl.tools import bench
from fadsl.tools.tune_measure import BenchTimer, Contender, Device, TimingRound, Workload
from fadsl.tools.variants import CHECKS, KNOWN_SPILLS, Base, neighbours, steps, values_key

HOPPER = ROOT / "examples" / "fa3_hopper.fa"
HDIM64 = ROOT / "examples" / "fa3_hdim64.fa"
HDIM64_CAUSAL = ROOT / "examples" / "fa3_hdim64_causal.fa"
BACKWARD = ROOT / "tests" / "specs" / "sm90" / "backward" / "fa3_backward.fa"
ACCEPTANCE = ROOT / "tests" / "specs" / "sm90" / "tune_causal_hdim64.fa"
SEQLENS = (1024, 4096)


def first_round(path: Path, text: str | None = None):
    base = Base.of(text or path.read_text(), str(path))
    return base, neighbours(base, base.values, {values_key(base.values)})


def persistent_hdim64_causal() -> str:
    """fa3_hdim64_causal persistent with 2 stages, whatever the example ships (the measured
    case behind the spill rule: persistent, causal, guarded at 160 registers)."""
    text = re.sub(r"scheduler  \w+", "scheduler  persistent", HDIM64_CAUSAL.read_text(), count=1)
    return re.sub(r"stages     \d+", "stages     2", text, count=1)


# --------------------------------------------------------------------------- variants


def test_fa3_hopper_has_variants_and_every_one_passes_every_check():
    base, found = first_round(HOPPER)
    assert len(found.variants) >= 10
    names = [v.name for v in found.variants]
    assert len(set(names)) == len(names)
    for variant in found.variants:
        compiled = compile_source(variant.text, f"{variant.name}.fa")  # SpecError fails it
        assert compiled.kernel.config.name == variant.name
        assert base.space.read(compiled.kernel.config) == variant.knobs
        assert variant.changes  # one knob moved (two where a repair moved another)


def test_each_knob_of_the_space_is_moved_somewhere():
    base, found = first_round(HOPPER)
    moved = {knob for v in found.variants for knob, _, _ in v.changes}
    # fa3_hopper uses `cluster 2`, so split_kv comes repaired with cluster 1
    assert moved == {k.name for k in base.space.knobs}


def test_invalid_combinations_are_pruned_and_counted():
    _, found = first_round(HDIM64_CAUSAL, persistent_hdim64_causal())
    refused = dict(found.refusals)
    assert found.pruned[CHECKS] >= 3 and found.pruned[KNOWN_SPILLS] == 0
    assert sum(found.pruned.values()) == len(found.refusals)
    assert "mask causal" in refused["cluster 1 -> 2"]
    assert "tiles of equal length" in refused["tail whole -> split_kv"]
    assert "setmaxnreg budget" in refused["B_c 128 -> 144"]
    for variant in found.variants:  # none of the refused values slipped through
        knobs = variant.knobs
        assert knobs["cluster"] == 1 and knobs["tail"] == "whole" and knobs["B_c"] <= 128
    _, hd256 = first_round(ROOT / "examples" / "fa3_hdim256.fa")
    assert "spills" in dict(hd256.refusals)["rescale lazy -> guarded"]
    assert hd256.pruned[KNOWN_SPILLS] == 1


def test_a_failed_move_is_repaired_by_the_nearest_passing_value():
    base, found = first_round(HOPPER)
    three = [v for v in found.variants if v.knobs["consumers"] == 3]
    assert len(three) == 1 and found.repaired >= 1
    (variant,) = three
    # 2 -> 3 consumers leaves 160 registers: B_c 128 needs about 184, 96 fits
    assert variant.knobs["B_c"] < 128 and variant.name == "fa3_hopper_c96_w3"
    assert "registers  producer = 32, consumers = 160" in variant.text
    assert "tile       B_r = 192, B_c = 96" in variant.text
    one = next(v for v in found.variants if v.knobs["consumers"] == 1)
    assert one.knobs["pingpong"] == "off"  # one consumer cannot ping-pong


def test_a_variant_that_reads_back_otherwise_is_refused_naming_the_knob():
    """An 8-bit spec's one-consumer move reads back with pingpong off (the spec leaves the
    key to its default): the refusal names the knob and both values, not the whole config."""
    _, found = first_round(ROOT / "examples" / "fa3_fp8_hdim128.fa")
    refused = dict(found.refusals)
    assert (
        refused["consumers 2 -> 1"] == "fa3_fp8_hdim128_w1 reads back with pingpong off (asked on)"
    )
    assert "rescale guarded lets P reach 2^14" in refused["rescale lazy -> guarded"]


def comments(text: str) -> list[str]:
    return [line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line]


def path_lines(text: str) -> list[str]:
    return [
        re.sub(r"smem\[\w+\]\s*", "smem[]", line)
        for line in text.splitlines()
        if ":" in line and "->" in line
    ]


def test_variants_keep_the_comments_the_paths_and_nested_blocks():
    source = BACKWARD.read_text()
    base, found = first_round(BACKWARD)
    block = source[source.index("  backward {") :]
    for variant in found.variants:
        for said in comments(source):
            assert said in variant.text
        assert path_lines(variant.text) == path_lines(source)
        assert variant.text.endswith(block)  # the backward block is never touched
        assert variant.name.startswith(base.config.name + "_")
    clustered = next(v for v in found.variants if v.knobs["cluster"] == 2)
    assert "K: gmem -tma-> smem[cluster]" in clustered.text
    assert "Q:   gmem -tma-> smem[cta]" in clustered.text  # the backward's own Q path


def test_a_missing_setting_is_added_at_kernel_level():
    source = BACKWARD.read_text()
    _, found = first_round(BACKWARD)
    q2 = next(v for v in found.variants if v.knobs["q_slots"] == 2)
    assert "q_slots" not in source
    added = q2.text.index("  q_slots    2\n")
    assert added < q2.text.index("  backward {")  # not inside the backward block
    assert front_end(q2.text).config.ext.q_slots == 2


def test_a_changed_line_keeps_its_comment_behind_the_old_value():
    _, found = first_round(HOPPER)
    s1 = next(v for v in found.variants if v.name == "fa3_hopper_s1")
    assert "  stages     1                          # was 2: K/V ring slots\n" in s1.text


def test_steps_move_along_ordered_knobs_nearest_first():
    values = tuple(range(48, 257, 16))
    assert steps(values, 112, 2) == [96, 128, 80, 144]
    assert steps(values, 48, 2) == [64, 80]
    assert steps(values, 120, 1) == [112, 128]  # off the list: its neighbours are one step
    assert steps(values, 120, 2) == [112, 128, 96, 144]
    assert steps(values, 300, 1) == [256]
    assert steps(("every", "lazy", "guarded"), "lazy", None) == ["every", "guarded"]


def test_sm80_variants_pass_its_checks():
    base, found = first_round(ROOT / "examples" / "fa2_kernel1.fa")
    assert found.variants and found.pruned[CHECKS] >= 1
    for variant in found.variants:
        cfg = front_end(variant.text).config
        assert cfg.block_r % (16 * cfg.warps) == 0
        assert variant.text.count("Q: gmem -cp.async-> smem[warp] -ldmatrix->") == 1


def test_sm90_known_spill_rule():
    rule = get("sm_90a").tune_space.likely_spills
    config = front_end(persistent_hdim64_causal()).config
    assert config.mask is Mask.CAUSAL and rule(config) is None  # lazy: fine
    guarded = replace(config, ext=replace(config.ext, rescale_mode=Rescale.GUARDED))
    assert rule(guarded) is None  # no longer spills (the header since 2026-11-27)
    hd256 = front_end((ROOT / "examples" / "fa3_hdim256.fa").read_text()).config
    assert "spills" in rule(replace(hd256, ext=replace(hd256.ext, rescale_mode=Rescale.GUARDED)))


def test_the_known_spill_rule_matches_ptxas(tmp_path, monkeypatch):
    """The measured case behind likely_spills, compiled (one NVRTC build): guarded at
    head_dim 256 spills, and the compile job refuses it."""
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    text = (ROOT / "examples" / "fa3_hdim256.fa").read_text()
    text = re.sub(r"rescale +\w+", "rescale    guarded", text, count=1)
    text = text.replace("kernel fa3_hdim256", "kernel guarded_hd256")
    built = build_variant(BuildJob("guarded_hd256", text, ("bf16",), ("sm_90a",)))
    assert built.verdict == SPILLS and "spill stores" in built.reason


# --------------------------------------------------------------------------- the search


class FakeTimer:
    """TF/s from the knobs: ``best`` scores highest, the others lower by how many knobs
    differ from it; the references fixed. Records every round it is asked to time."""

    def __init__(self, best: dict, drop: tuple[str, ...] = ()):
        self.best, self.drop = best, drop
        self.rounds = []

    def device(self):
        return Device("Fake H100", (9, 0))

    def tflops(self, knobs: dict, seqlen: int) -> float:
        misses = sum(knobs.get(k) != v for k, v in self.best.items())
        return 500.0 - 20.0 * misses + seqlen / 1024

    def __call__(self, round):
        self.rounds.append(round)
        out = {round.baseline.name: self.tflops(round.baseline.knobs, round.seqlen)}
        for c in round.contenders:
            if c.name not in self.drop:
                out[c.name] = self.tflops(c.knobs, round.seqlen)
        if round.final:
            out.update(flash=250.0, cudnn=400.0, fa4=450.0)
        return out


class FakeBuild:
    def __init__(self, spills: tuple[str, ...] = (), clock=None, seconds: float = 0.0):
        self.spills, self.clock, self.seconds = spills, clock, seconds
        self.jobs = []

    def __call__(self, job: BuildJob) -> Built:
        self.jobs.append(job)
        if self.clock is not None:
            self.clock.now += self.seconds
        if job.name in self.spills:
            return Built(job.name, SPILLS, "fake spill")
        return Built(job.name, OK)  # the fake timer needs no kernel


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def run_tune(path=HDIM64, **options):
    options.setdefault("seqlens", SEQLENS)
    options.setdefault("knobs", ["B_c", "stages"])
    options.setdefault("progress", io.StringIO())
    return tuning.tune(str(path), **options)


def test_the_fastest_variant_wins_and_is_written_with_its_header(tmp_path):
    timer = FakeTimer({"B_c": 96, "stages": 3})
    out = tmp_path / "best.fa"
    result = run_tune(timer=timer, build=FakeBuild(), cache=tmp_path / "m.json", output=out)
    assert result.winner.name == "fa3_hdim64_c96_s3"  # two moves away: found in round 2+
    assert result.rounds >= 2
    assert result.winner.variant.knobs["B_c"] == 96 and result.winner.variant.knobs["stages"] == 3
    text = out.read_text()
    header = text[: text.index("kernel ")]
    assert "on Fake H100" in header and "from fa3_hdim64 (" in header
    assert "bf16, mask none, head_dim 64, 16 heads" in header and "seqlens 1024, 4096" in header
    assert "Changed: B_c 128 -> 96, stages 2 -> 3." in header
    ratio = (500.0 + 1) / (500.0 - 40.0 + 1)  # the input misses both knobs
    assert f"x fa3_hdim64 {ratio:.3f} / " in header
    assert "x cuDNN " in header and "x FA4 " in header
    compiled = compile_source(text)  # the written spec is a spec, the winner's
    assert compiled.kernel.config.name == "fa3_hdim64_c96_s3"
    table = result.table()
    assert "fa3_hdim64_c96_s3 (winner)" in table and "fa3_hdim64 (input)" in table
    assert "x cuDNN" in table and "x SDPA flash" in table
    row = next(r for r in result.rows() if r["winner"])
    cudnn = (((500.0 + 1) / 400.0) * ((500.0 + 4) / 400.0)) ** 0.5  # the geometric mean
    assert row["method"] == "final" and row["x"]["cudnn"]["mean"] == pytest.approx(cudnn)
    final = [r for r in timer.rounds if r.final]
    assert len(final) == len(SEQLENS) and all(len(r.contenders) <= tuning.FINAL_TOP for r in final)


def test_a_different_fastest_variant_wins_instead():
    result = run_tune(timer=FakeTimer({"stages": 1}), build=FakeBuild(), cache=False)
    assert result.winner.name == "fa3_hdim64_s1"


def test_the_input_wins_when_no_variant_is_faster(tmp_path):
    result = run_tune(timer=FakeTimer({"B_c": 128, "stages": 2}), build=FakeBuild(), cache=False)
    assert result.winner is result.input
    assert "No variant beat the input" in result.spec_text


def test_spilling_and_wrong_variants_are_never_timed_or_chosen():
    timer = FakeTimer({"stages": 3}, drop=("fa3_hdim64_c112",))
    build = FakeBuild(spills=("fa3_hdim64_s3",))
    result = run_tune(timer=timer, build=build, cache=False)
    by_name = {c.name: c for c in result.candidates}
    assert by_name["fa3_hdim64_s3"].status == SPILLS
    assert by_name["fa3_hdim64_c112"].status.startswith("not measured")
    timed = {c.name for r in timer.rounds for c in r.contenders}
    assert "fa3_hdim64_s3" not in timed
    assert result.winner.name not in ("fa3_hdim64_s3", "fa3_hdim64_c112")


def test_a_rerun_answers_from_the_cache(tmp_path):
    cache = tmp_path / "measurements.json"
    first = run_tune(timer=FakeTimer({"B_c": 96}), build=FakeBuild(), cache=cache)
    again_timer, again_build = FakeTimer({"B_c": 96}), FakeBuild()
    again = run_tune(timer=again_timer, build=again_build, cache=cache)
    assert again_timer.rounds == [] and again_build.jobs == []  # nothing timed or built
    assert again.winner.name == first.winner.name
    assert again.winner.final == first.winner.final
    # another GPU, or --fresh, measures again
    other = FakeTimer({"B_c": 96})
    other.device = lambda: Device("Fake H200", (9, 0))
    run_tune(timer=other, build=FakeBuild(), cache=cache)
    assert other.rounds
    fresh = FakeTimer({"B_c": 96})
    run_tune(timer=fresh, build=FakeBuild(), cache=cache, fresh=True)
    assert fresh.rounds


def test_the_budget_stops_compiling_and_timing_new_variants():
    clock = Clock()
    build = FakeBuild(clock=clock, seconds=30.0)  # each compile takes half a minute
    timer = FakeTimer({"B_c": 96, "stages": 3})
    result = run_tune(timer=timer, build=build, cache=False, budget=2.0, clock=clock)
    unbounded = run_tune(timer=FakeTimer({"B_c": 96, "stages": 3}), build=FakeBuild(), cache=False)
    assert result.budget_spent
    statuses = [c.status for c in result.candidates]
    assert tuning.NOT_COMPILED in statuses
    # 2 minutes less the final round's fifth: 96 s, so the 4th compile is the last started
    assert len(build.jobs) == 4
    timed = {c.name for r in timer.rounds for c in r.contenders}
    assert all(c.name not in timed for c in result.candidates if c.status == tuning.NOT_COMPILED)
    assert len(result.candidates) < len(unbounded.candidates)
    assert "budget spent" in result.table()


def test_a_plateau_ends_after_patience_rounds_without_a_better_variant():
    flat = FakeTimer({})  # every variant as fast as the input
    result = run_tune(timer=flat, build=FakeBuild(), cache=False, knobs=None)
    assert result.rounds == tuning.PATIENCE and result.winner is result.input
    assert sum(c.expanded for c in result.candidates) == tuning.PATIENCE


class MoatTimer(FakeTimer):
    """``best`` highest; the input (which misses every knob of ``best``) next; any other
    variant lower: no one-knob climb (repairs included) leaves the input."""

    def tflops(self, knobs: dict, seqlen: int) -> float:
        misses = sum(knobs.get(k) != v for k, v in self.best.items())
        return {0: 520.0, len(self.best): 480.0}.get(misses, 440.0) + seqlen / 1024


def start_spec(tmp_path, name="start", **lines) -> Path:
    """fa3_hdim64 renamed, with its tile's B_c and its stages replaced as given."""
    text = HDIM64.read_text().replace("kernel fa3_hdim64 {", f"kernel {name} {{")
    if "B_c" in lines:
        text = text.replace("B_r = 192, B_c = 128", f"B_r = 192, B_c = {lines['B_c']}")
    if "stages" in lines:
        text = text.replace("stages     2 ", f"stages     {lines['stages']} ")
    path = tmp_path / f"{name}.fa"
    path.write_text(text)
    return path


def test_a_start_reaches_the_hill_a_climb_from_the_input_cannot(tmp_path):
    best = {"B_c": 96, "stages": 3}
    alone = run_tune(timer=MoatTimer(best), build=FakeBuild(), cache=False)
    assert alone.winner is alone.input  # the moat: every one-knob move loses
    timer = MoatTimer(best)
    start = start_spec(tmp_path, B_c=96, stages=3)
    result = run_tune(timer=timer, build=FakeBuild(), cache=False, starts=[start])
    assert result.winner.name == "fa3_hdim64_c96_s3"  # the input with the start's knobs
    first = timer.rounds[0]
    assert "fa3_hdim64_c96_s3" in {c.name for c in first.contenders}  # screened in round 1
    assert result.winner.variant.text.startswith(HDIM64.read_text()[:40])  # the input's text


def test_a_start_equal_to_the_input_or_to_a_neighbour_is_timed_once(tmp_path):
    timer = FakeTimer({"stages": 3})
    same, near = start_spec(tmp_path, "same"), start_spec(tmp_path, "near", stages=3)
    result = run_tune(timer=timer, build=FakeBuild(), cache=False, starts=[same, near])
    names = [c.name for c in result.candidates]
    assert len(names) == len(set(names)) and names.count("fa3_hdim64") == 1
    assert result.winner.name == "fa3_hdim64_s3"


def test_a_start_of_another_problem_or_refused_knobs_is_named(tmp_path):
    with pytest.raises(
        ValueError, match=r"--from .*fa3_hopper.fa: head_dim 128, the input's is 64"
    ):
        run_tune(timer=FakeTimer({}), build=FakeBuild(), cache=False, starts=[HOPPER])
    causal = HDIM64_CAUSAL
    with pytest.raises(ValueError, match=r"mask causal, the input's is none"):
        run_tune(timer=FakeTimer({}), build=FakeBuild(), cache=False, starts=[causal])
    # a start's knob the input's checks refuse: 7 stages fit the start's B_c 64, and with
    # --knobs stages only they are tried on the input's B_c 128 (over the SMEM)
    deep = start_spec(tmp_path, "deep", B_c=64, stages=7)
    with pytest.raises(ValueError, match=r"--from .*deep.fa: its knobs on fa3_hdim64: the SMEM"):
        run_tune(
            timer=FakeTimer({}), build=FakeBuild(), cache=False, starts=[deep], knobs=["stages"]
        )


def test_the_shipped_specs_for_the_inputs_problem_are_starts():
    """tune_causal_hdim64 (2 consumers, B_c 112, lazy) starts from fadsl.attention's two
    head_dim 64 causal specs as well: their knobs on its text."""
    base = Base.of(ACCEPTANCE.read_text(), str(ACCEPTANCE))
    starts = {v.name: dict(v.values) for v in shipped_starts(base)}
    shipped = [Base.of((ROOT / "examples" / f"{n}.fa").read_text(), n).values
               for n in ("fa3_hdim64_causal", "fa3_hdim64_causal_short")]  # fmt: skip
    assert sorted(starts.values(), key=str) == sorted(shipped, key=str)
    assert all(name.startswith("tune_causal_hdim64_") for name in starts)
    # the shipped spec itself, and a problem nothing ships (a window), have none
    assert shipped_starts(Base.of(HDIM64.read_text(), str(HDIM64))) == []
    windowed = ROOT / "tests" / "specs" / "sm90" / "fa3_window.fa"  # causal, window(256)
    assert shipped_starts(Base.of(windowed.read_text(), str(windowed))) == []


def test_a_search_starts_from_the_shipped_spec_unless_told_not_to():
    short = Base.of((ROOT / "examples" / "fa3_hdim64_causal_short.fa").read_text(), "s").values
    knobs = ["q_slots", "pingpong", "rescale"]
    best = {k: short[k] for k in knobs}
    options = dict(path=ACCEPTANCE, build=FakeBuild(), cache=False, knobs=knobs)
    alone = run_tune(timer=MoatTimer(best), shipped=False, **options)
    assert alone.winner is alone.input
    result = run_tune(timer=MoatTimer(best), **options)
    assert result.winner.name == "tune_causal_hdim64_q2_ppoff_guarded"


def test_cli_from_reads_its_specs_and_is_refused_with_backward(tmp_path, capsys):
    assert main(["tune", str(HDIM64), "--from", str(tmp_path / "missing.fa")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["tune", str(BACKWARD), "--backward", "--from", str(HDIM64)]) == 1
    assert "leave out --from" in capsys.readouterr().err


def test_max_rounds_bounds_the_search():
    result = run_tune(
        timer=FakeTimer({"B_c": 96, "stages": 3}), build=FakeBuild(), cache=False, max_rounds=1
    )
    assert result.rounds == 1 and result.winner.name != "fa3_hdim64_c96_s3"


def test_without_a_gpu_the_cpu_part_runs_then_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    build = FakeBuild(spills=("fa3_hdim64_s3",))
    progress = io.StringIO()
    with pytest.raises(tuning.NoGPUError) as err:
        tuning.tune(str(HDIM64), knobs=["stages"], build=build, cache=False, progress=progress)
    message = str(err.value)
    assert "timing needs a CUDA GPU, and none is visible" in message
    assert "3 variants of fa3_hdim64 passed the checks" in message
    assert "2 compiled into the cubin cache, 1 spill" in message
    assert len(build.jobs) == 3  # the first round was compiled
    assert "no CUDA GPU is visible" in progress.getvalue()
    assert {job.archs for job in build.jobs} == {("sm_90a",)}


def test_the_progress_bar_is_plain_text():
    progress = io.StringIO()
    run_tune(timer=FakeTimer({"stages": 3}), build=FakeBuild(), cache=False, progress=progress)
    lines = progress.getvalue().splitlines()
    assert any(re.search(r"compiling \[#+\.*\] \d+/\d+", line) for line in lines)
    assert any("round 1:" in line for line in lines) and "\r" not in progress.getvalue()


def test_tune_is_part_of_the_api():
    assert fadsl.tune is tuning.tune and "tune" in fadsl.__all__ and "TuneResult" in fadsl.__all__


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="--hidden 100 is not a positive multiple"):
        run_tune(timer=FakeTimer({}), build=FakeBuild(), cache=False, hidden=100)
    with pytest.raises(ValueError, match="keeps the spec's mask"):
        run_tune(timer=FakeTimer({}), build=FakeBuild(), cache=False, causal=True)
    with pytest.raises(ValueError, match="no knob warps here"):
        run_tune(timer=FakeTimer({}), build=FakeBuild(), cache=False, knobs=["warps"])
    with pytest.raises(SpecError):
        tuning.tune("kernel broken {\n}\n", timer=FakeTimer({}), build=FakeBuild(), cache=False)


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "args, code, said",
    [
        (["--budget", "0"], 2, "must be a positive number of minutes"),
        (["--budget", "soon"], 2, "expected a number of minutes"),
        (["--jobs", "0"], 2, "must be positive"),
        (["--seqlens", "1024,x"], 2, "comma-separated integers"),
        (["--heads", "8", "--hidden", "2048"], 2, "not allowed with argument"),
        (["--tokens", "8", "--batch", "2"], 2, "not allowed with argument"),
        (
            ["--hidden", "100"],
            1,
            "--hidden 100 is not a positive multiple of the spec's head_dim 64",
        ),
        (["--causal"], 1, "the tuner keeps the spec's mask"),
        (["--knobs", "B_c,warps"], 1, "no knob warps here; this target has B_c, consumers"),
    ],
)
def test_cli_argument_errors(args, code, said, capsys):
    try:
        status = main(["tune", str(HDIM64), *args])
    except SystemExit as exit:  # argparse's own refusals
        status = exit.code
    assert status == code
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def test_cli_refuses_a_folder_for_the_output_and_a_bad_or_missing_spec(tmp_path, capsys):
    assert main(["tune", str(HDIM64), "-o", str(tmp_path)]) == 1
    assert "is a folder" in capsys.readouterr().err
    assert main(["tune", str(tmp_path / "missing.fa")]) == 2
    assert "cannot read" in capsys.readouterr().err
    bad = tmp_path / "bad.fa"
    bad.write_text(HDIM64.read_text().replace("stages     2", "stages     9"))
    assert main(["tune", str(bad), "--list"]) == 2
    assert "bad.fa:" in capsys.readouterr().err


def test_cli_list_needs_no_gpu_and_compiles_nothing(capsys):
    assert main(["tune", str(ACCEPTANCE), "--list"]) == 0
    out = capsys.readouterr().out
    assert "tune_causal_hdim64" in out and "the first round's" in out
    assert re.search(r"tune_causal_hdim64_\w*w3", out)  # 3 consumers, repaired if needed
    assert "cluster 1 -> 2:" in out  # refused with the mask


def test_cli_without_a_gpu_compiles_the_first_round_in_parallel_then_exits_1(
    tmp_path, monkeypatch, capsys
):
    """The real compile pool: two NVRTC builds in two worker processes, into the cache."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    code = main(["tune", str(HDIM64), "--knobs", "q_slots,overlap", "--jobs", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "fadsl tune: timing needs a CUDA GPU, and none is visible" in err
    built = re.search(r"(\d+) compiled into the cubin cache, (\d+) spill", err)
    assert built and int(built[1]) + int(built[2]) == 2 and int(built[1]) >= 1
    assert "compiling [########################] 2/2" in err
    assert len(list(tmp_path.glob("fa3_hdim64_*.cubin"))) == 2  # the runtime's entries


# --------------------------------------------------------------------------- the GPU timer's glue


def fake_bench_run(calls: list, fail_together: bool = False):
    """bench.run's stand-in: the input 100 TF/s, each variant its own figure, in bench's
    result layout (contender names "fadsl", "fadsl:<kernel>", the references)."""

    def run(kern, **options):
        calls.append(options)
        against = options["against"]
        if fail_together and len(against) > 1:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")
        own = {"fa3_hdim64_s1": 110.0, "fa3_hdim64_s3": 180.0}
        base = 100.0 if len(against) != 1 or against[0].config.name == "fa3_hdim64_s1" else 200.0
        tflops = {"fadsl": base}
        tflops.update({f"fadsl:{k.config.name}": own[k.config.name] for k in against})
        if options["references"]:
            tflops.update(flash=50.0, cudnn=80.0)
        return {"rows": [{"tflops": tflops}]}

    return run


def timing_round(final: bool) -> TimingRound:
    base = Base.of(HDIM64.read_text(), str(HDIM64))
    contenders = []
    for stages in (1, 3):
        variant = base.variant(dict(base.values, stages=stages))
        contenders.append(Contender(variant.name, compile_source(variant.text)))
    workload = Workload("bf16", False, 64, 32, (1024,), tokens=16384)
    return TimingRound(
        Contender("fa3_hdim64", base.compiled), tuple(contenders), workload, 1024, final
    )


def test_the_bench_timer_screens_with_short_runs_and_no_references(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run", fake_bench_run(calls))
    got = BenchTimer()(timing_round(final=False))
    assert got == {"fa3_hdim64": 100.0, "fa3_hdim64_s1": 110.0, "fa3_hdim64_s3": 180.0}
    (options,) = calls
    assert options["seqlens"] == (1024,) and options["tokens"] == 16 * 1024
    assert options["heads"] == 32 and options["dtype_name"] == "bf16" and not options["causal"]
    assert (options["warmup"], options["runs"], options["rounds"]) == (8, 32, 2)
    assert options["references"] is False and options["on_wrong"] is not None


def test_the_bench_timer_final_round_is_bench_with_the_references(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run", fake_bench_run(calls))
    got = BenchTimer()(timing_round(final=True))
    assert got["flash"] == 50.0 and got["cudnn"] == 80.0
    (options,) = calls
    assert (options["warmup"], options["runs"], options["rounds"]) == (32, 128, None)
    assert options["references"] is True


def test_the_bench_timer_times_one_at_a_time_when_together_fails(monkeypatch):
    calls, said = [], []
    monkeypatch.setattr(bench, "run", fake_bench_run(calls, fail_together=True))
    got = BenchTimer(log=said.append)(timing_round(final=False))
    # each variant's ratio to the input is its own run's: s3 ran with the input at 200
    assert got == {"fa3_hdim64": 100.0, "fa3_hdim64_s1": 110.0, "fa3_hdim64_s3": 90.0}
    assert len(calls) == 3 and "one at a time" in said[0]
