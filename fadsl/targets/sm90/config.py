"""sm_90a's settings beyond the common ones (``Config.ext``): warp specialisation, the
pipeline and its variants; their line in the IR's text form, printed and read back."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...ir import Rescale, TargetConfig


@dataclass(frozen=True)
class Sm90Config(TargetConfig):
    """sm_90a's warp specialisation and pipeline (None on sm_80)."""

    consumers: int  # consumer warpgroups, 64 query rows each
    stages: int  # K/V ring slots
    producer_regs: int  # setmaxnreg.dec of the producer warpgroup
    consumer_regs: int  # setmaxnreg.inc of each consumer warpgroup
    swizzle_bytes: int  # TMA/wgmma swizzle span: 128
    pingpong: bool  # named-barrier turns between consumer warpgroups
    overlap: bool  # S(j+1) in flight during softmax(j)
    # The CTA runs a sequence of tiles either way; persistent: about one CTA per SM, each
    # looping over many tiles; off ("scheduler grid"): one CTA per tile.
    persistent: bool = True
    # Lazy ("rescale lazy"): a row keeps the max its P is scaled by until the max grows past
    # 2^8 of it, so O's rescale (a multiply per O register) is skipped in most blocks;
    # every ("rescale every"): rescaled after each block, as FlashAttention-2/3; guarded:
    # lazy, and no row max after the first block while the row sums show none is needed.
    rescale_mode: Rescale = Rescale.LAZY
    # Q slots: tile t's Q in slot t % q_slots; with 2 the producer loads the next tile's Q
    # while this tile's runs (its barriers a ring of tiles, Parity.TILE).
    q_slots: int = 1
    # `tail split_kv`: the launch's last, part-full round of tiles is split over the K/V
    # blocks into pieces for the idle CTAs; each piece's warpgroup writes its partial O, m
    # and l to a workspace, and the last to finish a tile combines them and stores it.
    split_kv: bool = False
    # `cluster 2`: pairs of CTAs on q-tiles of one (batch, head), each loading half of
    # every K/V block and multicasting it into both (TMA .multicast::cluster)
    cluster: int = 1
    # The `cluster N` kernel this cluster-free variant runs for where a launch does not use
    # its clusters (fadsl/targets/sm90/alone.py); None for a spec's own kernel.
    alone_of: str | None = None
    # `softcap N`: the scores capped by N tanh(s softmax_scale / N) before the softmax; 0: off
    softcap: int = 0
    # `varlen on`: packed batches of sequences of any lengths (cu_seqlens_q/k); tiles never
    # straddle two sequences, and a small kernel before the main one lists the (sequence,
    # q block) tiles longest K/V loop first (emit/sm90/include/fadsl/sm90_varlen.cuh)
    varlen: bool = False
    # `kv_cache contiguous|paged(N)`: K/V from a cache with per-batch lengths; -1: no cache,
    # 0: contiguous, N: pages of N rows (fadsl/sm90_kvcache.cuh)
    kv_cache: int = -1
    # `pack_gqa on`: a K/V head's query heads share its tiles' rows
    pack_gqa: bool = False
    # `splits auto`: every tile split over its K/V blocks, a combine kernel after (split_kv
    # is set too: the pieces' schedule and proof are the split tail's)
    split_all: bool = False
    # `ctas_per_sm 2`: two CTAs of the kernel resident on an SM (__launch_bounds__' minimum:
    # half the register file each at launch); the persistent grid counts them
    ctas_per_sm: int = 1

    @property
    def scheduler(self) -> str:
        """The `scheduler` setting as a spec spells it."""
        return "persistent" if self.persistent else "grid"

    @property
    def rescale(self) -> str:
        """The `rescale` setting as a spec spells it."""
        return self.rescale_mode.value

    @property
    def lazy_rescale(self) -> bool:
        """O is multiplied only in blocks where some row's reference moved."""
        return self.rescale_mode is not Rescale.EVERY

    @property
    def guarded(self) -> bool:
        """Blocks after a tile's first skip the row max (`rescale guarded`)."""
        return self.rescale_mode is Rescale.GUARDED

    def text(self) -> str:
        on = {True: "on", False: "off"}
        return (
            f"sm90 consumers={self.consumers} stages={self.stages} "
            f"regs={self.producer_regs}/{self.consumer_regs} swizzle={self.swizzle_bytes}B "
            f"pingpong={on[self.pingpong]} overlap={on[self.overlap]} "
            f"scheduler={self.scheduler} rescale={self.rescale}"
            + (f" q_slots={self.q_slots}" if self.q_slots > 1 else "")
            + (" tail=split_kv" if self.split_kv else "")
            + (f" cluster={self.cluster}" if self.cluster > 1 else "")
            + (f" softcap={self.softcap}" if self.softcap else "")
            + (" varlen=on" if self.varlen else "")
            + (f" kv_cache={self.kv_cache}" if self.kv_cache >= 0 else "")
            + (" pack_gqa=on" if self.pack_gqa else "")
            + (" splits=auto" if self.split_all else "")
            + (f" ctas_per_sm={self.ctas_per_sm}" if self.ctas_per_sm > 1 else "")
            + (f" alone_of={self.alone_of}" if self.alone_of else "")
        )


_TEXT = re.compile(
    r"sm90 consumers=(?P<consumers>\d+) stages=(?P<stages>\d+) "
    r"regs=(?P<preg>\d+)/(?P<creg>\d+) swizzle=(?P<swizzle>\d+)B "
    r"pingpong=(?P<pingpong>on|off) overlap=(?P<overlap>on|off) "
    r"scheduler=(?P<scheduler>persistent|grid) rescale=(?P<rescale>every|lazy|guarded)"
    r"(?: q_slots=(?P<q_slots>\d+))?(?P<split_kv> tail=split_kv)?(?: cluster=(?P<cluster>\d+))?"
    r"(?: softcap=(?P<softcap>\d+))?(?P<varlen> varlen=on)?"
    r"(?: kv_cache=(?P<kv_cache>\d+))?(?P<pack_gqa> pack_gqa=on)?(?P<split_all> splits=auto)?"
    r"(?: ctas_per_sm=(?P<ctas_per_sm>\d+))?(?: alone_of=(?P<alone_of>\S+))?$"
)


def read_config(line: str) -> Sm90Config | None:
    """The Sm90Config that ``Sm90Config.text`` printed; None for a line that is not an
    sm90 line, ValueError for a malformed one."""
    if not line.startswith("sm90 "):
        return None
    m = _TEXT.match(line)
    if m is None:
        raise ValueError("expected 'sm90 consumers=N stages=N regs=P/C ...'")
    return Sm90Config(
        consumers=int(m["consumers"]),
        stages=int(m["stages"]),
        producer_regs=int(m["preg"]),
        consumer_regs=int(m["creg"]),
        swizzle_bytes=int(m["swizzle"]),
        pingpong=m["pingpong"] == "on",
        overlap=m["overlap"] == "on",
        persistent=m["scheduler"] == "persistent",
        rescale_mode=Rescale(m["rescale"]),
        q_slots=int(m["q_slots"] or 1),
        split_kv=m["split_kv"] is not None or m["split_all"] is not None,
        cluster=int(m["cluster"] or 1),
        alone_of=m["alone_of"],
        softcap=int(m["softcap"] or 0),
        varlen=m["varlen"] is not None,
        kv_cache=int(m["kv_cache"]) if m["kv_cache"] is not None else -1,
        pack_gqa=m["pack_gqa"] is not None,
        split_all=m["split_all"] is not None,
        ctas_per_sm=int(m["ctas_per_sm"] or 1),
    )
