"""`scheduler persistent` in the backward block (issue 44): the key, its refusals, the Cfg and
the kernel's source, the proof over tile sequences (with its mutations), the header's calls
per tile, the host's grid, and NVRTC builds without spills."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from backward_header import HEADER, TEMPLATE, expected_calls, header_calls, kernel_body, squash
from register_usage import assert_no_spills, kernel_usages
from fadsl.errors import SpecError
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward import host
from fadsl.targets.sm90.backward.emit import context
from fadsl.targets.sm90.backward.plan_smem import plan_smem
from fadsl.targets.sm90.backward.program import Kind, Mbar, Params, WaitParity, WarpRole
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import (
    check_protocol,
    m_counts,
    persistent_space,
    tile_counts,
)
from training_specs import training_spec

FILE = "persistent.fa"
EXAMPLES = ("fa3_hopper", "fa3_causal", "fa3_hdim64", "fa3_hdim64_causal")
SHIPPED = ("fa3_hdim64",)  # the examples whose backward block says `scheduler persistent`
PERSISTENT = persistent_space()


def compiled(name: str):
    return compile_source(training_spec(name), FILE)


# --- the key ------------------------------------------------------------------------------


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_key_reaches_the_ir_and_the_template(example):
    bwd = compiled(f"{example}+persistent").kernel.backward
    assert bwd.persistent and bwd.text().endswith(" scheduler=persistent")
    assert read_backward(bwd.text(), bwd.loc).persistent
    assert compiled(example).kernel.backward.persistent == (example in SHIPPED)
    assert not compiled(f"{example}-persistent").kernel.backward.persistent
    kernel = compiled(f"{example}+persistent").kernel
    assert context(kernel, kernel.config.dtypes[0])["persistent"]
    # kv_empty: 8 bytes more of mbarriers (than the grid block without late_v's v_full)
    grid = compiled(f"{example}-persistent-late_v").kernel.backward
    grid = plan_smem(grid, kernel.config.head_dim)
    tiles = plan_smem(bwd, kernel.config.head_dim)
    assert tiles.buffers[-1].nbytes == grid.buffers[-1].nbytes + 8


def _located(name: str, fragment: str) -> None:
    text = training_spec(name)
    with pytest.raises(SpecError) as err:
        compile_source(text, FILE)
    message = str(err.value)
    assert "scheduler persistent" in message and fragment in message, message
    line = next(n for n, x in enumerate(text.split("\n"), 1) if "scheduler persistent" in x)
    assert f"{FILE}:{line}:" in message, message


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("fa3_causal+persistent+deterministic-dqred", "deterministic on"),
        ("fa3_causal+persistent+dq_writer-dqred", "dq_writer on"),
        ("fa3_hdim256+persistent", "head_dim 256"),
        ("serving/fa3_varlen_causal+persistent", "varlen on"),
    ],
)
def test_the_combinations_not_built_are_refused_at_the_key(name, fragment):
    _located(name, fragment)


def test_a_wrong_word_is_refused():
    text = training_spec("fa3_causal+persistent").replace("scheduler persistent", "scheduler often")
    with pytest.raises(SpecError, match="persistent"):
        compile_source(text, FILE)


# --- the source ---------------------------------------------------------------------------


def test_the_source_runs_the_roles_per_tile():
    body = squash(kernel_body(False, persistent=True))
    for role in (
        "bwd_producer<Cfg>(P,smem,block,run);",
        "bwd_consumer<Cfg>(P,smem,block,warpgroup-1,run);",
    ):
        loop = "for(inttile=blockIdx.x;tile<tiles;tile+=gridDim.x){"
        tile = "constBwdBlockblock=bwd_tile_block<Cfg>(P,tile);"
        assert loop + tile + role + "run=bwd_next_run(run,block);}" in body
    # without the key: one block per CTA, no run
    assert "bwd_tile_block" not in kernel_body(False) and "run" not in squash(kernel_body(False))
    assert "{% if persistent %}" in TEMPLATE


def test_the_grid_is_one_cta_per_sm_at_most(monkeypatch):
    monkeypatch.setattr(host, "sm_count", lambda index: 132)
    device = SimpleNamespace(index=0)
    grid, tiles = SimpleNamespace(persistent=False), SimpleNamespace(persistent=True)
    assert host.main_grid(grid, 8, 16, 2, device) == (8, 16, 2)
    assert host.main_grid(tiles, 8, 16, 2, device) == (132, 1, 1)
    assert host.main_grid(tiles, 3, 2, 1, device) == (6, 1, 1)


# --- the proof ----------------------------------------------------------------------------


def test_the_cases_are_tile_sequences():
    for params in PERSISTENT:
        cases = m_counts(params)
        assert cases == tile_counts(params)
        assert (2 * params.stages + 1, params.stages + 2) in cases and (1, 0, 1) in cases


@pytest.mark.parametrize("params", PERSISTENT, ids=lambda p: p.describe())
def test_the_persistent_plan_is_proven(params):
    assert check_protocol(protocol(params)) == ()


@pytest.mark.parametrize("params", PERSISTENT, ids=lambda p: p.describe())
@pytest.mark.parametrize("role", list(WarpRole), ids=lambda r: r.value)
def test_the_header_makes_the_persistent_calls(role, params):
    assert header_calls(role, params) == expected_calls(protocol(params), role)


def _without(proto, role, n, item=None):
    items = proto.role(role)
    return proto.with_role(role, items[:n] + ((item,) if item else ()) + items[n + 1 :])


FLIP = {WaitParity.TILE: WaitParity.TILE_FLIP, WaitParity.TILE_FLIP: WaitParity.TILE}


@pytest.mark.parametrize("params", PERSISTENT[:3] + PERSISTENT[-2:], ids=lambda p: p.describe())
def test_each_kv_sync_dropped_or_flipped_is_refused(params):
    proto = protocol(params)
    seen = 0
    for role in (WarpRole.PRODUCER, WarpRole.CONSUMER):
        for n, x in enumerate(proto.role(role)):
            if x.mbar not in (Mbar.KV_FULL, Mbar.KV_EMPTY) or x.kind is Kind.TMA_LOAD:
                continue
            seen += 1
            assert check_protocol(_without(proto, role, n)), (role, x)
            if x.parity is not None:
                for parity in (FLIP[x.parity], WaitParity.ZERO, WaitParity.ONE):
                    mutant = _without(proto, role, n, replace(x, parity=parity))
                    assert check_protocol(mutant), (role, x, parity)
    assert seen == 4  # the producer's wait and arm, the consumers' wait and arrive


def test_a_ring_restarted_per_tile_is_refused(monkeypatch):
    """The model's running index is what makes the ring continue: restarted per tile, the
    proof finds the dS^T buffer or the ring's phase wrong."""
    from fadsl.targets.sm90.backward import verify

    def restarted(items, m_count, peeled=False):
        counts = m_count if isinstance(m_count, tuple) else (m_count,)
        out, t = [], 0
        for m in counts:
            out += [(x, i, t) for x, i in verify.unrolled(items, m, 0, peeled)]
            t += m > 0
        return out

    params = PERSISTENT[0]
    assert check_protocol(protocol(params)) == ()
    monkeypatch.setattr(verify, "tiles_unrolled", restarted)
    assert check_protocol(protocol(params))


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("the producer's ring per tile", "const int slot = run_i % Cfg::kStages;\n    const uint32_t phase", "const int slot = i % Cfg::kStages;\n    const uint32_t phase"),
        ("dS^T's buffer per tile", "(run_i % 2) * Cfg::kDSBytes", "(i % 2) * Cfg::kDSBytes"),
        ("kv_full's phase 0", "static_cast<uint32_t>(run.kv) & 1u);\n  } else", "0u);\n  } else"),
        ("kv_empty unflipped", "(static_cast<uint32_t>(run.kv) & 1u) ^ 1u", "static_cast<uint32_t>(run.kv) & 1u"),
        ("no kv_empty arrive", "    if (b.m_count > 0) mbar_arrive(bwd_bar_kv_empty<Cfg>(smem));\n", ""),
        ("no kv_empty wait", "    mbar_wait_parity(bwd_bar_kv_empty<Cfg>(smem), (static_cast<uint32_t>(run.kv) & 1u) ^ 1u);\n", ""),
    ],
)  # fmt: skip
def test_an_edited_persistent_header_is_caught(what, old, new):
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    params = PERSISTENT[5]
    roles = (WarpRole.PRODUCER, WarpRole.CONSUMER)
    assert any(
        header_calls(r, params, edited) != expected_calls(protocol(params), r) for r in roles
    )


# --- builds -------------------------------------------------------------------------------


def test_the_examples_build_persistent_without_spills():
    seen = []
    for example in EXAMPLES:
        result = compiled(f"{example}+persistent")
        assert result.kernel.backward.persistent
        seen += kernel_usages(result)
    backward = [(kernel, usage) for kernel, usage in seen if "bwd" in kernel]
    assert len(backward) >= 2 * len(EXAMPLES), seen
    assert_no_spills(backward)
