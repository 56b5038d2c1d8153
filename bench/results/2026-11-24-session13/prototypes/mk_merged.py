"""Write .carry/h64q.cu (bench/specs/fa3_hdim64_q2_split as generated) and .carry/h64m.cu
(the same with each tile's first S = Q K^T issued in the previous tile's last turn, behind
its last P V, and the O store's fence, barrier and TMA store after the next tile's first
softmax). Kernel symbol: KERNEL_NAME."""

from pathlib import Path

src = (
    Path("/tmp/q2s/fa3_hdim64_q2_split_bf16.cu")
    .read_text()
    .replace("fa3_hdim64_q2_split_bf16", "KERNEL_NAME")
)
Path(".carry/h64q.cu").write_text(src)
start = src.index("    int tile_count = 0;  // as the producer's")
end = src.index("    // ping-pong: warpgroup 0 takes the last warpgroup's final hand-over")
consumer = r"""    int tile_count = 0;  // as the producer's
    int ring_base = 0;
    // PROTO: non-causal, seqlen_k > 0 (no tile without keys).
    int tile = warp_uniform(split_tile_index<Cfg>(P, 0));
    if (tile >= 0) {  // the first tile's first S in a turn of its own
      mbar_wait_parity(bar_q_full(0), tile_phase(0));
      mbar_wait_parity(bar_k_full(ring_slot(0)), ring_phase(0));
      named_bar_sync(5 + wg, 256);
      wgmma_fence();
      issue_qk<Cfg>(s, smem_q + wg * 64 * Cfg::kRowBytes, k_slot(ring_slot(0)));
      wgmma_commit();
      named_bar_arrive(5 + (wg + 1) % Cfg::kConsumerWGs, 256);
    }
    bool store_pending = false;
    int store_tile = 0;
    for (int step = 0; tile >= 0; ++step) {
      const int next_tile = warp_uniform(split_tile_index<Cfg>(P, step + 1));
      const TileWork w = split_tile_work<Cfg>(P, tile);
      const RowLimits rows = row_limits<Cfg>(w, wg, warp, lane);
      FADSL_TILE_MARK(step, 0);
      const uint32_t smem_q_wg = smem_q + (tile_count % 2) * Cfg::kQBytes + wg * 64 * Cfg::kRowBytes;
      m[0] = m[1] = -INFINITY;
      l[0] = l[1] = 0.f;
      {
        const int it = 0;
        wgmma_wait<0>();
        fence_regs(s);
        if (lane == 0) mbar_arrive(bar_k_empty(ring_slot(ring_base + it)));
        if (w.n_masked > 0) mask_scores<Cfg>(s, P.base, rows, w.block_end - 1 - (it), lane);
        online_softmax<Cfg>(s, m, l, scale, scale_log2);
        if (store_pending) {  // the previous tile's O, in SMEM since its last turn
          fence_proxy_async_smem();
          named_bar_sync(2 + wg, 128);
          if (warp == 0 && elect_one()) {
            store_o_tma<Cfg>(P, smem_o_wg, split_tile_work<Cfg>(P, store_tile), wg);
            tma_store_commit();
          }
          store_pending = false;
        }
        convert_p<Cfg>(s, p);
      }
      #pragma unroll
      for (int i = 0; i < Cfg::kORegs; ++i) o[i] = 0.f;
      FADSL_TILE_MARK(step, 1);
      auto iteration = [&](const int it, auto mask_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        mbar_wait_parity(bar_k_full(ring_slot(ring_base + it)), ring_phase(ring_base + it));
        named_bar_sync(5 + wg, 256);
        wgmma_fence();
        issue_qk<Cfg>(s, smem_q_wg, k_slot(ring_slot(ring_base + it)));
        wgmma_commit();
        rescale_o<Cfg>(o, scale);
        mbar_wait_parity(bar_v_full(ring_slot(ring_base + it - 1)), ring_phase(ring_base + it - 1));
        wgmma_fence();
        issue_pv<Cfg>(o, p, v_slot(ring_slot(ring_base + it - 1)));
        wgmma_commit();
        named_bar_arrive(5 + (wg + 1) % Cfg::kConsumerWGs, 256);
        wgmma_wait<1>();
        fence_regs(s);
        if (lane == 0) mbar_arrive(bar_k_empty(ring_slot(ring_base + it)));
        if constexpr (kMask) mask_scores<Cfg>(s, P.base, rows, w.block_end - 1 - (it), lane);
        online_softmax<Cfg>(s, m, l, scale, scale_log2);
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(p);
        if (lane == 0) mbar_arrive(bar_v_empty(ring_slot(ring_base + it - 1)));
        convert_p<Cfg>(s, p);
      };
      int it = 1;
      for (; it < w.n_masked; ++it) iteration(it, fadsl::sm90::true_type{});
      for (; it < w.n_blocks; ++it) iteration(it, fadsl::sm90::false_type{});
      FADSL_TILE_MARK(step, 2);
      {
        const int it = w.n_blocks;
        if (lane == 0) mbar_arrive(bar_q_empty(tile_count % 2));
        rescale_o<Cfg>(o, scale);
        mbar_wait_parity(bar_v_full(ring_slot(ring_base + it - 1)), ring_phase(ring_base + it - 1));
        if (warp == 0 && elect_one()) tma_store_wait_read<0>();
        const bool has_next = next_tile >= 0;
        if (has_next) {  // the next tile's Q and first K
          mbar_wait_parity(bar_q_full((tile_count + 1) % 2), tile_phase((tile_count + 1) / 2));
          mbar_wait_parity(bar_k_full(ring_slot(ring_base + it)), ring_phase(ring_base + it));
        }
        named_bar_sync(5 + wg, 256);
        wgmma_fence();
        issue_pv<Cfg>(o, p, v_slot(ring_slot(ring_base + it - 1)));
        wgmma_commit();
        if (has_next) {
          issue_qk<Cfg>(s, smem_q + ((tile_count + 1) % 2) * Cfg::kQBytes + wg * 64 * Cfg::kRowBytes,
                        k_slot(ring_slot(ring_base + it)));
        }
        wgmma_commit();
        named_bar_arrive(5 + (wg + 1) % Cfg::kConsumerWGs, 256);
        wgmma_wait<1>();
        fence_regs(o);
        fence_regs(p);
        if (lane == 0) mbar_arrive(bar_v_empty(ring_slot(ring_base + it - 1)));
      }
      FADSL_TILE_MARK(step, 3);
      ring_base += w.n_blocks;
      ++tile_count;
      {
        const TileWork w = split_tile_work<Cfg>(P, tile);
        const RowLimits rows = row_limits<Cfg>(w, wg, warp, lane);
        if (!(w.split >= 0 && !combine_split<Cfg>(P, w, wg, o, m, l, scale_log2, threadIdx.x % 128))) {
          row_sum_quad(l);
          store_lse<Cfg>(P.base, w, rows, m, l, scale_log2, lane);
          normalize_o<Cfg>(o, l);
          store_o_smem<Cfg>(o, smem_o_wg, warp, lane);
          store_pending = true;
          store_tile = tile;
        }
        FADSL_TILE_MARK(step, 4);
      }
      tile = next_tile;
    }
    if (store_pending) {
      fence_proxy_async_smem();
      named_bar_sync(2 + wg, 128);
      if (warp == 0 && elect_one()) {
        store_o_tma<Cfg>(P, smem_o_wg, split_tile_work<Cfg>(P, store_tile), wg);
        tma_store_commit();
      }
    }
"""
Path(".carry/h64m.cu").write_text(src[:start] + consumer + src[end:])
