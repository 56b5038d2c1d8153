"""`cluster 2`'s cluster-free variant (fadsl/targets/sm90/alone.py): the kernel the runtime
launches where a launch does not pair CTAs, compiled beside the pair kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fadsl
from conftest import ROOT
from fadsl.cli import main
from fadsl.codegen.render import render
from fadsl.ir import Dtype, Scope
from fadsl.pipeline import compile_file
from fadsl.targets.sm90.caps import CLUSTER_ARRIVE, CLUSTER_WAIT, MBAR_ARRIVE_PEER
from test_cache import needs_nvrtc

HOPPER = "examples/fa3_hopper.fa"
TWIN = "tests/specs/bench/fa3_hopper_cluster_off.fa"  # fa3_hopper without `cluster 2`, by hand


@pytest.fixture(scope="module")
def compiled():
    return compile_file(HOPPER)


def sync_kinds(kernel) -> set:
    return {sync.kind for sync in kernel.syncs()}


def test_a_cluster_spec_compiles_a_cluster_free_variant(compiled):
    alone = compiled.alone
    assert alone is not None and alone.alone is None
    cfg = alone.kernel.config
    assert cfg.name == "fa3_hopper_alone" and cfg.ext.alone_of == "fa3_hopper"
    assert cfg.ext.cluster == 1 and compiled.kernel.config.ext.cluster == 2
    assert all(b.scope is not Scope.CLUSTER for b in alone.kernel.buffers)
    assert all(t.smem_scope is not Scope.CLUSTER for t in alone.kernel.tensors)
    # through every pass, the proof included, from the same schedule
    assert [name for name, _ in alone.stages] == [name for name, _ in compiled.stages]
    assert {MBAR_ARRIVE_PEER, CLUSTER_ARRIVE, CLUSTER_WAIT} <= sync_kinds(compiled.kernel)
    assert not {MBAR_ARRIVE_PEER, CLUSTER_ARRIVE, CLUSTER_WAIT} & sync_kinds(alone.kernel)


def test_the_variant_is_the_kernel_of_the_spec_written_without_cluster(compiled):
    """The variant's CUDA is the hand-written cluster-free twin's, but for names and header."""
    twin = compile_file(TWIN)
    for ours, theirs in zip(
        render(compiled.alone.kernel, compiled.alone.target, compiled.file),
        render(twin.kernel, twin.target, twin.file),
        strict=True,
    ):
        body = [
            line
            for line in ours.text.replace("fa3_hopper_alone", "fa3_hopper_cluster_off").splitlines()
            if not line.startswith("//")
        ]
        assert body == [line for line in theirs.text.splitlines() if not line.startswith("//")]
        assert "the cluster-free variant of fa3_hopper_" in ours.text


def test_specs_without_a_cluster_have_no_variant():
    assert compile_file("examples/fa3_hdim64.fa").alone is None
    assert compile_file("examples/fa2_pipelined.fa").alone is None
    assert fadsl.load(TWIN, verbose=False).alone is None


def test_the_runtime_holds_the_variant(compiled):
    kern = fadsl.load(HOPPER, verbose=False)
    assert kern.alone is not None and kern.alone.config.name == "fa3_hopper_alone"
    assert kern.alone.alone is None
    source = kern.alone.source("bf16")
    assert "void __launch_bounds__(Cfg::kThreads, 1) fa3_hopper_alone_bf16(" in source
    assert "cluster_arrive" not in source and "mbar_arrive_cluster" not in source


def test_compile_writes_both_kernels(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["compile", HOPPER, "-o", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.cu"))
    assert names == [  # and the spec's backward, once (the variant has none)
        "fa3_hopper_alone_bf16.cu",
        "fa3_hopper_alone_fp16.cu",
        "fa3_hopper_bf16.cu",
        "fa3_hopper_bwd_bf16.cu",
        "fa3_hopper_bwd_fp16.cu",
        "fa3_hopper_fp16.cu",
    ]


@needs_nvrtc
def test_aot_build_writes_the_variant_too(tmp_path, monkeypatch):
    out = tmp_path / "cubins"
    fadsl_cli = str(Path(sys.executable).parent / "fadsl")
    proc = subprocess.run(
        [fadsl_cli, "build", HOPPER, "--arch", "sm_90a", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    stems = sorted(c.name.split(".")[0] for c in out.glob("*.cubin"))
    assert stems == [
        "fa3_hopper_alone_bf16",
        "fa3_hopper_alone_fp16",
        "fa3_hopper_bf16",
        "fa3_hopper_fp16",
    ]
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path / "cache"))

    def no_build(*args, **kwargs):
        raise AssertionError("built although an ahead-of-time cubin was there")

    monkeypatch.setattr(fadsl.runtime.attention, "compile_cubin", no_build)
    kern = fadsl.load(ROOT / HOPPER, cubin_dirs=[out])
    assert kern.alone.cubin(Dtype.BF16, "sm_90a").path.parent == out


def test_explain_names_the_variant_and_the_variant_says_what_it_is(compiled):
    from fadsl.build.spill_check import RegisterCheck
    from fadsl.tools.report import explain_text

    unchecked = RegisterCheck((), "--no-compile")
    assert "cluster-free variant, fa3_hopper_alone" in explain_text(compiled, unchecked)
    text = explain_text(compiled.alone, unchecked)
    assert "alone      the cluster-free variant of fa3_hopper:" in text
    assert "cluster    2" not in text


def test_the_register_check_compiles_the_variant_too(compiled):
    from fadsl.build.spill_check import Usage, check_registers

    seen = []

    def compiler(source, arch):
        seen.append(source.kernel_name)
        return Usage(registers=128)

    check_registers(compiled, compiler, "fake")
    assert sorted(set(seen)) == [  # and the spec's backward kernels
        "fa3_hopper_alone_bf16",
        "fa3_hopper_alone_fp16",
        "fa3_hopper_bf16",
        "fa3_hopper_bwd_bf16",
        "fa3_hopper_bwd_fp16",
        "fa3_hopper_fp16",
    ]


def test_a_spilling_variant_is_refused_by_its_name(compiled):
    from fadsl.build.spill_check import Usage, check_registers
    from fadsl.errors import SpecError

    def compiler(source, arch):  # only the variant spills
        spills = source.kernel_name.startswith("fa3_hopper_alone")
        return Usage(240, 64 if spills else 0, 64 if spills else 0, 0)

    with pytest.raises(SpecError, match="its cluster-free variant fa3_hopper_alone does not fit"):
        check_registers(compiled, compiler, "fake")


def test_a_failing_variant_is_named(monkeypatch):
    """The spec's own kernel passes first; a problem only the variant has says it is the
    variant's (a located SpecError, or a pass's own error with a note)."""
    from dataclasses import replace

    import fadsl.targets.sm90 as sm90
    from fadsl.errors import Diagnostic, SpecError

    def refuse_the_variant(kernel, target):
        if kernel.config.ext.alone_of:
            raise SpecError([Diagnostic(kernel.config.loc, "no room")])
        return kernel

    passes = (*sm90.TARGET.passes, ("refuse", refuse_the_variant))
    monkeypatch.setattr(sm90, "TARGET", replace(sm90.TARGET, passes=passes))
    with pytest.raises(SpecError, match="in its cluster-free variant fa3_hopper_alone: no room"):
        compile_file(HOPPER)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, pairs",
    [
        (4096, 4096, True),
        (256, 4096, True),
        (384, 4096, False),
        (4096, 2048, False),
        (1, 65, False),
    ],
)
def test_launches_that_do_not_pair_run_the_variant(seqlen_q, seqlen_k, pairs, monkeypatch):
    """(No GPU: the pair kernel's launch path is cut at its first step.) Pairs need an even
    count of query blocks and 32 K/V blocks or more (fadsl.targets.sm90.host.launch.launch_cluster).
    """
    import torch

    from fadsl import targets

    kern = fadsl.load(HOPPER, verbose=False)
    ran = []

    class PairPath(Exception):
        pass

    class Launch:  # the target's launch, cut after the cluster decision
        cluster = staticmethod(targets.launch_for("sm_90a").cluster)
        before = None  # (no kernel launched first)

        def pack(self, kernel, args):
            raise PairPath

    monkeypatch.setattr(kern, "_launch", Launch())
    monkeypatch.setattr(kern.alone, "launch_args", lambda *args: ran.append(args))
    q = torch.zeros(1, seqlen_q, 2, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(1, seqlen_k, 2, 128, dtype=torch.bfloat16)
    if pairs:
        with pytest.raises(PairPath):
            kern.launch(Dtype.BF16, q, k, v, torch.empty_like(q), None, 0.1)
        assert not ran
    else:
        kern.launch(Dtype.BF16, q, k, v, torch.empty_like(q), None, 0.1)
        assert len(ran) == 1 and ran[0][1].q is q and ran[0][2] == 1
