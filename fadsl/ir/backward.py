"""The backward pass's settings: a spec's ``backward { ... }`` block, validated.

A kernel without the block is forward-only (``Kernel.backward`` is None). The backward's
kernels (preprocess, main, postprocess) are the target's: sm_90a's are under
fadsl/targets/sm90/backward/ and docs/backward.md describes them. The front end reads the
block (fadsl/frontend/backward.py) and the target checks it and fills in its defaults
(``Target.validate_backward``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import Loc
from .hop import Hop
from .types import WARPGROUP_THREADS, GradRole, Level, Role, Scope


@dataclass(frozen=True)
class BackwardTensor:
    """One tensor's path in the backward block: Q, K and V (``Role``) or a gradient or a
    row statistic (``GradRole``). Unlike the forward's ``Tensor``, a path may skip SMEM
    (dK, dV: rf -st.global-> gmem) or leave registers and come back (dS: rf -> smem -> rf)."""

    role: Role | GradRole
    hops: tuple[Hop, ...]
    smem_scope: Scope | None  # None: the path has no smem level
    loc: Loc

    def path_text(self) -> str:
        parts = [self.hops[0].src.value]
        for hop in self.hops:
            level = hop.dst.value
            if hop.dst is Level.SMEM and self.smem_scope is not None:
                level += f"[{self.smem_scope.value}]"
            parts.append(f"-{hop.instr.value}-> {level}")
        return " ".join(parts)


@dataclass(frozen=True)
class Backward:
    block_m: int  # B_r: queries per m-block (the inner loop's step)
    block_n: int  # B_c: keys per CTA (the n-block each CTA owns)
    consumers: int  # MMA warpgroups; each owns block_n / consumers keys of dK and dV
    producer_regs: int  # setmaxnreg.dec of the producer warpgroup
    consumer_regs: int  # setmaxnreg.inc of each consumer warpgroup
    stages: int  # Q / dO ring slots
    deterministic: bool  # dQ's accumulation ordered by n-block: bitwise-stable gradients
    loc: Loc  # the block's `backward` keyword
    # dQ issued before dV and dK and staged while they run (sm90_bwd_consumer.cuh, bwd_consumer)
    overlap: bool = False
    # with overlap: dV issued as soon as P^T is packed, before dS (sm90_bwd_consumer.cuh,
    # bwd_consumer)
    early_dv: bool = False
    # with overlap: dV issued after the dS^T store, before the warpgroups meet (its product
    # under the meeting; FlashAttention-3's order; sm90_bwd_consumer.cuh, bwd_consumer)
    dv_before_meeting: bool = False
    # with overlap and dQ by red.add: dQ of m-block i - 1 issued in m-block i, after dV, so
    # that the consumer warpgroups never meet (sm90_bwd_lag.cuh, bwd_consumer_lagged)
    dq_lag: bool = False
    # with dq_lag: dQ(i - 1) issued before dV(i), not between dV(i) and dK(i), so that its
    # adds run under both dV and dK (sm90_bwd_lag.cuh, Cfg::kDqFirst)
    dq_first: bool = False
    # dQ's path is `rf -red.add-> gmem`: added into the accumulator from registers, no staging
    dq_red: bool = False
    # CTAs launched n-block by n-block across heads and batches (the causal mask's longest
    # first) rather than head by head (sm90_bwd.cuh, bwd_block)
    longest_first: bool = False
    # dQ's staged share reduce-added by a writer warp of the producer warpgroup per consumer
    # (research/backward-dq-writer.md; sm90_bwd_writer.cuh, bwd_dq_writer)
    dq_writer: bool = False
    # with deterministic and dq_writer: each (m-block, share) accumulator split into this many
    # chains of tickets, place p adding into chain p mod N after place p - N, the conversion
    # summing the chains in chain order (sm90_bwd_writer.cuh, bwd_dq_writer); 1: one chain
    dq_chains: int = 1
    # dS's path is `rf -stmatrix-> smem[cta]` where dS^T keeps the keys as rows (not B_r 80):
    # its 8 x 8 blocks stored whole, four per stmatrix (sm90_bwd_ds.cuh, store_ds_stmatrix)
    ds_stmatrix: bool = False
    # `scheduler persistent`: about one CTA per SM, each looping over (n-block, head, batch)
    # tiles, the next tile's K and V loaded under this one's epilogue (sm90_bwd_persistent.cuh)
    persistent: bool = False
    # dQ converted to the input dtype by the main kernel's CTA that completes each m-block's
    # adds, not by a convert_dq kernel after it (sm90_bwd_convert.cuh, bwd_finish_dq)
    fused_convert: bool = False
    # dK's and dV's paths are `rf -stmatrix-> smem[warpgroup] -tma-> gmem`: each consumer
    # warpgroup stages its rows in the dead K and V tiles and one thread stores them by TMA
    # (sm90_bwd_lag.cuh, store_grad_kv_tma); not `rf -st.global-> gmem` from registers
    dkv_tma: bool = False
    # the producer prefetches into the L2 the K and V tiles of the CTA launched a wave
    # (%nsmid CTAs) after its own, as it issues its last loads: that CTA's loads then hit
    # the L2 (sm90_bwd_producer.cuh, bwd_prefetch_later_kv)
    prefetch_kv: bool = False
    # with dK and dV by TMA: dV staged in its dead V rows and stored before the last m-block's
    # dQ (its store then runs under that dQ), not after it (sm90_bwd_lag.cuh)
    dv_out_first: bool = False
    # with dq_lag: a consumer warpgroup whose keys are all masked for every query of its
    # tile's first m-block (past the keys, or past the last query's right edge: the causal
    # diagonal's second warpgroup at B_c 128) skips that m-block's products and hands over
    # a zero dS^T panel (sm90_bwd_lag.cuh, bwd_hand_over_dead)
    peel_dead: bool = False
    # with dq_lag, one tile per CTA: K alone on the K/V barrier, V loaded after the first
    # m-block's Q, dO, LSE and D on a barrier of its own, so S^T's first wgmma waits for K
    # alone (sm90_bwd_producer.cuh, bwd_load_v_late)
    late_v: bool = False
    # Every tensor's path, the defaults included, in the target's order. The IR's text form
    # leaves them out (the target admits one path per tensor): a kernel read back has none.
    tensors: tuple[BackwardTensor, ...] = ()
    key_locs: tuple[tuple[str, Loc], ...] = ()  # where the block set each key

    @property
    def threads(self) -> int:
        """The main kernel's threads: one producer warpgroup and the consumers."""
        return WARPGROUP_THREADS * (1 + self.consumers)

    @property
    def keys_per_consumer(self) -> int:
        """The keys of the n-block whose dK and dV rows each consumer warpgroup owns."""
        return self.block_n // self.consumers

    def loc_of(self, key: str) -> Loc:
        return dict(self.key_locs).get(key, self.loc)

    def tensor(self, role: Role | GradRole) -> BackwardTensor:
        for tensor in self.tensors:
            if tensor.role is role:
                return tensor
        raise KeyError(role)

    def text(self) -> str:
        """One line of the IR's text form."""
        return (
            f"backward B_r={self.block_m} B_c={self.block_n} consumers={self.consumers} "
            f"regs={self.producer_regs}/{self.consumer_regs} stages={self.stages} "
            f"deterministic={'on' if self.deterministic else 'off'}"
            + (" overlap=on" if self.overlap else "")
            + (" early_dv=on" if self.early_dv else "")
            + (" dv_before_meeting=on" if self.dv_before_meeting else "")
            + (" dq_lag=on" if self.dq_lag else "")
            + (" dq_first=on" if self.dq_first else "")
            + (" dq=red.add" if self.dq_red else "")
            + (" longest_first=on" if self.longest_first else "")
            + (" dq_writer=on" if self.dq_writer else "")
            + (f" dq_chains={self.dq_chains}" if self.dq_chains != 1 else "")
            + (" ds=stmatrix" if self.ds_stmatrix else "")
            + (" scheduler=persistent" if self.persistent else "")
            + (" fused_convert=on" if self.fused_convert else "")
            + (" dkv=tma" if self.dkv_tma else "")
            + (" prefetch_kv=on" if self.prefetch_kv else "")
            + (" dv_out_first=on" if self.dv_out_first else "")
            + (" peel_dead=on" if self.peel_dead else "")
            + (" late_v=on" if self.late_v else "")
        )


_TEXT = re.compile(
    r"backward B_r=(?P<m>\d+) B_c=(?P<n>\d+) consumers=(?P<consumers>\d+) "
    r"regs=(?P<preg>\d+)/(?P<creg>\d+) stages=(?P<stages>\d+) "
    r"deterministic=(?P<deterministic>on|off)(?P<overlap> overlap=on)?(?P<early_dv> early_dv=on)?(?P<dv_before_meeting> dv_before_meeting=on)?(?P<dq_lag> dq_lag=on)?(?P<dq_first> dq_first=on)?(?P<dq_red> dq=red.add)?(?P<longest_first> longest_first=on)?(?P<dq_writer> dq_writer=on)?(?: dq_chains=(?P<dq_chains>\d+))?(?P<ds_stmatrix> ds=stmatrix)?(?P<persistent> scheduler=persistent)?(?P<fused_convert> fused_convert=on)?(?P<dkv_tma> dkv=tma)?(?P<prefetch_kv> prefetch_kv=on)?(?P<dv_out_first> dv_out_first=on)?(?P<peel_dead> peel_dead=on)?(?P<late_v> late_v=on)?$"
)


def read_backward(line: str, loc: Loc) -> Backward:
    """The Backward that ``Backward.text`` printed as ``line`` (ValueError if it is not one);
    its paths and key locations are not in the text, so it has none."""
    m = _TEXT.match(line)
    if m is None:
        raise ValueError(
            "expected 'backward B_r=N B_c=N consumers=N regs=P/C stages=N deterministic=on|off'"
        )
    return Backward(
        block_m=int(m["m"]),
        block_n=int(m["n"]),
        consumers=int(m["consumers"]),
        producer_regs=int(m["preg"]),
        consumer_regs=int(m["creg"]),
        stages=int(m["stages"]),
        deterministic=m["deterministic"] == "on",
        overlap=m["overlap"] is not None,
        early_dv=m["early_dv"] is not None,
        dv_before_meeting=m["dv_before_meeting"] is not None,
        dq_lag=m["dq_lag"] is not None,
        dq_first=m["dq_first"] is not None,
        dq_red=m["dq_red"] is not None,
        longest_first=m["longest_first"] is not None,
        dq_writer=m["dq_writer"] is not None,
        dq_chains=int(m["dq_chains"] or 1),
        ds_stmatrix=m["ds_stmatrix"] is not None,
        persistent=m["persistent"] is not None,
        fused_convert=m["fused_convert"] is not None,
        dkv_tma=m["dkv_tma"] is not None,
        prefetch_kv=m["prefetch_kv"] is not None,
        dv_out_first=m["dv_out_first"] is not None,
        peel_dead=m["peel_dead"] is not None,
        late_v=m["late_v"] is not None,
        loc=loc,
    )
