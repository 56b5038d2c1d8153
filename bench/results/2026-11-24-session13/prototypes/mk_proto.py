"""Write .carry/h64x.cu (E prep before the last P V wait, fast rcp/lg2, Q prefetched into
L2 a tile ahead) and .carry/h64y.cu (the same without the prefetch) from the generated
fa3_hdim64_bf16.cu and the working tree's header."""

from pathlib import Path

gen = Path("generated/fa3_hdim64_bf16.cu").read_text()
header = Path("emit/sm90/include/fadsl/sm90.cuh").read_text()


def sub(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


header = sub(
    header,
    "for (int r = 0; r < 2; ++r) inv[r] = l[r] == 0.f ? 0.f : 1.f / l[r];",
    'for (int r = 0; r < 2; ++r) { float x; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(x) : "f"(l[r])); inv[r] = l[r] == 0.f ? 0.f : x; }',
)
header = sub(header, "(m[r] * scale_log2 + log2f(l[r]))", "(m[r] * scale_log2 + __log2f(l[r]))")
body = sub(gen, '#include "fadsl/sm90.cuh"', header)
body = sub(
    body,
    "      FADSL_TILE_MARK(step, 2);  // the mainloop is done\n",
    "      FADSL_TILE_MARK(step, 2);  // the mainloop is done\n"
    "      const TileWork w_done = split_tile_work<Cfg>(P, tile);\n"
    "      const RowLimits rows_done = row_limits<Cfg>(w_done, wg, warp, lane);\n",
)
body = sub(
    body,
    "        // hazard RAW on O (rf): pv -> normalize (within each warpgroup)\n        wgmma_wait<0>();",
    "        row_sum_quad(l);\n        // hazard RAW on O (rf): pv -> normalize (within each warpgroup)\n        wgmma_wait<0>();",
)
body = sub(
    body,
    "        const TileWork w = split_tile_work<Cfg>(P, tile);\n        const RowLimits rows = row_limits<Cfg>(w, wg, warp, lane);\n",
    "        const TileWork& w = w_done;\n        const RowLimits& rows = rows_done;\n",
)
body = sub(body, "        row_sum_quad(l);\n        store_lse", "        store_lse")
Path(".carry/h64y.cu").write_text(body)
prefetch = """          load_q<Cfg>(P, smem_q, bar_q_full, w);
          {  // the next tile's Q into L2 (no SMEM, no barrier)
            const int next = split_tile_index<Cfg>(P, step + 1);
            if (next >= 0) {
              const TileWork nw = split_tile_work<Cfg>(P, next);
              for (int panel = 0; panel < Cfg::kPanels; ++panel)
                asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(&P.tma_q), "r"(64 * panel), "r"(nw.m0), "r"(nw.head), "r"(nw.batch) : "memory");
            }
          }
"""
body = sub(body, "          load_q<Cfg>(P, smem_q, bar_q_full, w);\n", prefetch)
Path(".carry/h64x.cu").write_text(body)
