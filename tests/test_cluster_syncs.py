"""cluster_syncs (sm_90a, `cluster 2`): the syncs it adds to insert_syncs' plan, before and
after, and the host's cluster launch arithmetic."""

from __future__ import annotations

from dataclasses import replace

import torch

from conftest import ROOT
from gpu_specs import single_ctas
from fadsl import targets
from fadsl.ir import Phase, Scope, Sync, Threads
from fadsl.targets.launch import Args
from fadsl.targets.sm90.host.launch import (
    launch_cluster,
    PAIR_MIN_KV_BLOCKS,
    m_blocks,
    resident_ctas,
    tile_count,
    tile_grid,
)
from fadsl.targets import launch_for
from fadsl.pipeline import front_end
from fadsl.targets.sm90 import caps
from fadsl.targets.sm90.syncs import cluster as cluster_syncs

CLUSTER = (ROOT / "examples" / "fa3_hopper.fa").read_text()
HOPPER = single_ctas(CLUSTER)  # the same kernel without `cluster 2`


def cluster_source() -> str:
    """examples/fa3_hopper.fa: `cluster 2`, K and V in smem[cluster]."""
    assert "cluster    2" in CLUSTER and "smem[cluster]" in CLUSTER
    return CLUSTER


def through(source: str, last: str):
    """The kernel after pass ``last`` (and the one before it)."""
    kernel = front_end(source, "cluster.fa")
    target = targets.target_of(kernel)
    before = kernel
    for name, run in target.passes:
        before, kernel = kernel, run(kernel, target)
        if name == last:
            return before, kernel
    raise AssertionError(last)


def syncs(kernel, kind) -> list[Sync]:
    return [s for s in kernel.syncs() if s.kind is kind]


def test_cluster_one_is_left_alone():
    before, after = through(HOPPER, "cluster_syncs")
    assert after is before


def test_the_spec_reaches_the_ir():
    _, kernel = through(cluster_source(), "insert_syncs")
    assert kernel.config.ext.cluster == 2
    scopes = {b.name: b.scope for b in kernel.buffers}
    assert scopes == {
        "Q": Scope.WARPGROUP,
        "K": Scope.CLUSTER,
        "V": Scope.CLUSTER,
        "O": Scope.WARPGROUP,
    }


def test_empty_barriers_count_both_ctas_and_hear_from_the_peer():
    before, after = through(cluster_source(), "cluster_syncs")
    counts = {s.barrier: s.count for s in syncs(before, caps.MBAR_INIT)}
    new_counts = {s.barrier: s.count for s in syncs(after, caps.MBAR_INIT)}
    doubled = {"k_empty": 2 * counts["k_empty"], "v_empty": 2 * counts["v_empty"]}
    assert new_counts == {**counts, **doubled}
    # every local arrival on a K/V empty barrier is followed, at once, by the same warp's
    # arrival on the peer's barrier of the same slot; Q's empty barrier stays local
    for phase, items in after.phases():
        for i, item in enumerate(items):
            if isinstance(item, Sync) and item.kind is caps.MBAR_ARRIVE_PEER:
                local = items[i - 1]
                assert local.kind is caps.MBAR_ARRIVE
                assert (local.barrier, local.lag, local.who) == (item.barrier, item.lag, item.who)
                assert item.barrier in ("k_empty", "v_empty")
                assert all("peer CTA" in h.describe() for h in item.serves)
    local = [s for s in syncs(after, caps.MBAR_ARRIVE) if s.barrier in ("k_empty", "v_empty")]
    assert len(syncs(after, caps.MBAR_ARRIVE_PEER)) == len(local) > 0
    assert not [s for s in syncs(after, caps.MBAR_ARRIVE_PEER) if s.barrier == "q_empty"]
    # the full barriers still expect the whole tile: half from each CTA's multicast
    assert [s.tx for s in syncs(after, caps.MBAR_EXPECT_TX)] == [
        s.tx for s in syncs(before, caps.MBAR_EXPECT_TX)
    ]


def test_cluster_barriers_after_init_and_at_exit():
    before, after = through(cluster_source(), "cluster_syncs")
    kinds = [s.kind for s in after.setup if isinstance(s, Sync) and s.who is Threads.ALL_WARPS]
    assert kinds == [caps.CLUSTER_ARRIVE_RELAXED, caps.CLUSTER_WAIT]
    assert caps.SYNCTHREADS in [s.kind for s in before.setup if isinstance(s, Sync)]
    assert not syncs(after, caps.SYNCTHREADS)
    order = [s.kind for s in after.setup if isinstance(s, Sync)]
    assert order.index(caps.FENCE_MBAR_INIT) < order.index(caps.CLUSTER_ARRIVE_RELAXED)
    *rest, arrive, wait = after.teardown
    assert (arrive.kind, wait.kind) == (caps.CLUSTER_ARRIVE, caps.CLUSTER_WAIT)
    assert arrive.who is wait.who is Threads.ALL_WARPS and arrive.phase is Phase.TEARDOWN
    assert tuple(rest) == before.teardown


def test_the_emitted_code_multicasts_and_arrives_on_the_peer():
    _, kernel = through(cluster_source(), "cluster_syncs")
    from fadsl.codegen.render import render

    source, *_ = render(kernel, targets.target_of(kernel), "cluster.fa")
    text = source.text
    assert "static constexpr int kClusterSize = 2;" in text
    assert text.count("load_kv_multicast<Cfg>(") == 4 and "load_kv<Cfg>(" not in text
    assert text.count("cluster_rank, cluster_ctas);") == 4  # the loads: alone, whole tiles
    # the peer arrivals: no branch; a CTA launched alone is its own peer
    assert "cluster_peer = cluster_rank ^ (cluster_ctas - 1u);" in text
    assert text.count("mbar_arrive_cluster(bar_k_empty(") == 2
    assert text.count("mbar_arrive_cluster(bar_v_empty(") == 2
    assert "mbar_init(bar_k_empty(s), 16);" in text and "mbar_init(bar_q_empty, 8);" in text
    assert "__syncthreads();" not in text
    # the exit barrier comes after both roles' branches, for every thread
    assert text.rstrip().endswith(
        "cluster_arrive();\n  // until every thread of the cluster has arrived\n  cluster_wait();\n}"
    )


def args(batch, seqlen_q, heads, seqlen_k=4096):
    q = torch.zeros(batch, seqlen_q, heads, 128, dtype=torch.bfloat16)
    k = torch.zeros(batch, seqlen_k, heads, 128, dtype=torch.bfloat16)
    return Args(q, k, k, torch.empty_like(q), None, 1.0)


def test_pairs_only_when_the_query_blocks_pair_up_over_long_kv_loops(monkeypatch):
    _, kernel = through(cluster_source(), "cluster_syncs")
    _, single = through(HOPPER, "cluster_syncs")
    seqlens = (1, 128, 129, 256, 257, 2048, 2112)
    assert [launch_cluster(kernel, s, 4096) for s in seqlens] == [1, 1, 2, 2, 1, 2, 1]
    assert [launch_cluster(single, s, 4096) for s in seqlens] == [1] * len(seqlens)
    # K/V loops of PAIR_MIN_KV_BLOCKS blocks or more only
    min_keys = PAIR_MIN_KV_BLOCKS * 128
    assert [launch_cluster(kernel, 256, n) for n in (1, min_keys - 128, min_keys - 127)] == [
        1,
        1,
        2,
    ]
    assert [m_blocks(kernel, s, 2) for s in (1, 129, 257)] == [2, 2, 4]  # as num_m_blocks
    assert tile_count(kernel, args(3, 2112, 5)) == 17 * 5 * 3  # 17 blocks: no pairs
    monkeypatch.setattr(
        "fadsl.targets.sm90.host.launch.sm_count", lambda index: 133
    )  # an odd SM count
    assert resident_ctas(0, 2) == 132 and resident_ctas(0, 1) == 133
    assert tile_grid(kernel, args(3, 2048, 5)) == (132, 1, 1)  # persistent, in pairs
    assert tile_grid(kernel, args(3, 2112, 5)) == (133, 1, 1)  # alone
    assert tile_grid(kernel, args(3, 2048, 5, seqlen_k=2048)) == (133, 1, 1)  # alone
    assert tile_grid(kernel, args(1, 256, 1)) == (2, 1, 1)
    launch = launch_for("sm_90a")
    assert launch.cluster(kernel, args(1, 256, 1)) == 2
    assert launch.cluster(kernel, args(1, 300, 1)) == 1
    grid_sched = replace(
        kernel,
        config=replace(kernel.config, ext=replace(kernel.config.ext, persistent=False)),
    )
    assert tile_grid(grid_sched, args(1, 512, 3)) == (12, 1, 1)


def test_the_emitter_multicasts_by_the_buffers_scope():
    """Which loads are multicast is the buffers' scope, for the emitter as for the sync pass
    and verify: a V left in smem[cta] (as no spec can say today) is loaded whole, locally."""
    from fadsl.codegen.render import render

    kernel = front_end(cluster_source(), "cluster.fa")
    kernel = replace(
        kernel,
        buffers=tuple(replace(b, scope=Scope.CTA) if b.name == "V" else b for b in kernel.buffers),
    )
    target = targets.target_of(kernel)
    for name, run in target.passes:
        kernel = run(kernel, target)
    source, *_ = render(kernel, target, "cluster.fa")
    assert source.text.count("load_kv_multicast<Cfg>(&P.tma_k,") == 2
    assert source.text.count("load_kv<Cfg>(&P.tma_v,") == 2
    assert "mbar_arrive_cluster(bar_v_empty(" not in source.text
