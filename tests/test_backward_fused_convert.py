"""`fused_convert on` (emit/sm90/include/fadsl/sm90_bwd_convert.cuh): dQ converted by the main
kernel's CTA whose count completes an m-block. What a GPU is not needed for:

- the count each m-block's counter must reach, bwd_dq_contributors, compiled for the host
  with nvcc and run here, against the m-block ranges of the header's own bwd_block_at for
  every n-block (no mask, causal, windows, causal with a window; seqlen_q above and below
  seqlen_k, so that leading queries see no key); host.py's copy of it, and its keyless rows
  (the rows no CTA converts, which the host zeroes), against the same;
- the knob: read, printed and read back, refused at its key where the count or its counters
  would not hold, and the kernels it makes build without spills;
- the host's launches: no convert_dq where the main kernel converts, dQ's pointer and strides
  at FUSED_OFFSET, convert_dq again past FUSED_CONVERT_MAX_QUERIES queries.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT
from host_program import run_host_program
from fadsl.build.nvrtc import compile_cubin
from fadsl.build.spill_check import find_compiler
from register_usage import assert_no_spills, kernel_usages
from fadsl.codegen.render import render_backward
from fadsl.errors import SpecError
from fadsl.ir import Mask, Window
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets import target_of
from fadsl.targets.sm90.backward import host
from fadsl.targets.sm90.backward.emit import FUSED_CONVERT_MAX_QUERIES
from fadsl.targets.sm90.backward.finish import finish_plan
from fadsl.targets.sm90.backward.verify_finish import finish_problems
from fadsl.tools.report import explain_data, explain_text
from fadsl.tools.sass import disassemble, function, nvdisasm

FILE = "t.fa"
EXAMPLES = ROOT / "examples"

# name, head_dim, B_r, causal, window (left, right) or None, B_c (128 unless head_dim 256's)
CONFIGS = [
    ("none80", 128, 80, False, None),
    ("causal80", 128, 80, True, None),
    ("causal128", 64, 128, True, None),
    ("causal64", 128, 64, True, None),
    ("window80", 128, 80, False, (100, 30)),
    ("window64", 128, 64, False, (0, 0)),
    ("causalwindow128", 64, 128, True, (200, 0)),
    ("causal256", 256, 64, True, None, 80),
    ("window256", 256, 64, False, (70, 10), 64),
    ("none256", 256, 64, False, None, 64),
]

PROGRAM = r"""
#include "fadsl/sm90_bwd.cuh"
#include <cstdio>
#include <vector>
using namespace fadsl::sm90;
{configs}
template <class Cfg>
void run(const char* name) {{
  const int lengths[] = {{1, 2, 63, 64, 65, 79, 80, 81, 127, 128, 129, 200, 333, 640, 1000, 1023}};
  for (int sq : lengths)
    for (int sk : lengths) {{
      BwdParamsSm90 P{{}};
      P.seqlen_q = sq;
      P.seqlen_k = sk;
      P.m_blocks = (sq + Cfg::kBlockM - 1) / Cfg::kBlockM;
      P.group = 1;
      const int n_blocks = (sk + Cfg::kBlockN - 1) / Cfg::kBlockN;
      std::vector<int> visits(P.m_blocks, 0);
      BwdBlock any{{}};
      for (int n = 0; n < n_blocks; ++n) {{
        const BwdBlock b = bwd_block_at<Cfg>(P, n, 0, 0, n_blocks, 1, 1);
        any = b;
        for (int i = 0; i < b.m_count; ++i) ++visits[b.m_begin + i];
      }}
      any.seqlen_q = sq;
      any.seqlen_k = sk;
      for (int m = 0; m < P.m_blocks; ++m)
        printf("%s %d %d %d %d %d\n", name, sq, sk, m, visits[m], bwd_dq_contributors<Cfg>(any, m));
    }}
}}
template <class Cfg>
void run_varlen(const char* name) {{
  // packed sequences (q lengths, k lengths): empty ones, queries before every key, odd lengths
  const std::vector<std::vector<int>> packings[] = {{
      {{{{5, 0, 300, 1, 129, 700}}, {{5, 7, 100, 0, 333, 65}}}},
      {{{{81, 80, 79, 160}}, {{200, 1, 79, 1000}}}},
      {{{{0, 640, 2, 0, 1023, 77}}, {{3, 1, 0, 64, 128, 500}}}},
      {{{{1, 1, 1, 257, 300}}, {{1000, 0, 2, 256, 12}}}},
  }};
  for (const auto& packing : packings) {{
    std::vector<int> cu_q{{0}}, cu_k{{0}};
    for (size_t s = 0; s < packing[0].size(); ++s) {{
      cu_q.push_back(cu_q.back() + packing[0][s]);
      cu_k.push_back(cu_k.back() + packing[1][s]);
    }}
    BwdParamsSm90 P{{}};
    P.sequences = static_cast<int>(packing[0].size());
    P.cu_seqlens_q = cu_q.data();
    P.cu_seqlens_k = cu_k.data();
    P.seqlen_q = cu_q.back();
    P.seqlen_k = cu_k.back();
    P.group = 1;
    const int chunks = (P.seqlen_q + P.sequences * Cfg::kBlockM) / Cfg::kBlockM + 1;
    const int slots = (P.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN + P.sequences;
    std::vector<int> visits(chunks, 0);
    for (int x = 0; x < slots; ++x) {{
      const BwdBlock b = bwd_block_at<Cfg>(P, x, 0, 0, slots, 1, 1);
      for (int i = 0; i < b.m_count; ++i) ++visits[b.chunk0 + b.m_begin + i];
    }}
    for (int chunk = 0; chunk < chunks; ++chunk) {{
      // the chunk's sequence and m-block, as bwd_keyless_chunk finds them
      const int s = bwd_varlen_sequence(cu_q.data(), P.sequences, Cfg::kBlockM, chunk);
      const BwdQueryRows rows = bwd_query_rows<Cfg>(cu_q.data(), P.sequences, P.seqlen_q, chunk);
      if (!bwd_chunk_holds_query<Cfg>(rows, chunk)) continue;
      BwdBlock b{{}};
      b.seqlen_q = cu_q[s + 1] - cu_q[s];
      b.seqlen_k = cu_k[s + 1] - cu_k[s];
      const int m = chunk - bwd_first_slot(cu_q.data(), s, Cfg::kBlockM);
      // (the preprocess zeroes a chunk's rows where bwd_keyless_chunk says none visits it)
      const bool keyless = bwd_keyless_chunk<Cfg>(cu_q.data(), cu_k.data(), P.sequences, chunk);
      printf("%s %d %d %d %d %d\n", name, P.seqlen_q, P.seqlen_k, chunk, visits[chunk],
             keyless ? 0 : bwd_dq_contributors<Cfg>(b, m));
    }}
  }}
}}
int main() {{
{runs}
}}
"""


# `varlen on`: the chunks of packed sequences, each sequence's m-blocks from its first slot
VARLEN_CONFIGS = [
    c for c in CONFIGS if c[0] in ("none80", "causal80", "causal128", "window64", "window80")
]


def _config(name, head_dim, block_m, causal, window, block_n=128, varlen=False) -> str:
    c = "true" if causal else "false"
    name += "_varlen" if varlen else ""
    # (head_dim 256: dQ by red.add, the split consumers' static_assert)
    red = ", false, false, false, true" if head_dim == 256 else ""
    base = f"BwdConfig<__nv_bfloat16, {head_dim}, {block_m}, {block_n}, 2, 2, {c}{red}>"
    lines = [f"struct {name} : {base} {{"]
    if varlen:
        lines.append("  static constexpr bool kVarlen = true;")
    if window:
        lines.append(f"  static constexpr int kWindowLeft = {window[0]};")
        lines.append(f"  static constexpr int kWindowRight = {window[1]};")
    return "\n".join(lines + ["};"])


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    """(config, seqlen_q, seqlen_k, m) -> (n-blocks whose range holds m, bwd_dq_contributors)."""
    program = PROGRAM.format(
        configs="\n".join(_config(*c) for c in CONFIGS)
        + "\n".join(_config(*c, varlen=True) for c in VARLEN_CONFIGS),
        runs="\n".join(f'  run<{c[0]}>("{c[0]}");' for c in CONFIGS)
        + "\n".join(f'  run_varlen<{c[0]}_varlen>("{c[0]}_varlen");' for c in VARLEN_CONFIGS),
    )
    lines = run_host_program(tmp_path_factory.mktemp("contributors"), "count", program)
    found = {}
    for line in lines.splitlines():
        name, *values = line.split()
        sq, sk, m, visits, contributors = map(int, values)
        found[(name, sq, sk, m)] = (visits, contributors)
    return found


def stand_in(name: str):
    """What host.dq_contributors reads of a kernel, for one of CONFIGS."""
    _, head_dim, block_m, causal, window, *block_n = next(c for c in CONFIGS if c[0] == name)
    return SimpleNamespace(
        backward=SimpleNamespace(block_m=block_m, block_n=block_n[0] if block_n else 128),
        config=SimpleNamespace(
            mask=Mask.CAUSAL if causal else Mask.NONE,
            window=Window(*window) if window else None,
            head_dim=head_dim,
        ),
    )


def test_the_count_is_the_n_blocks_that_visit_the_m_block(counts):
    """Padded calls by (batch, head) m-block, packed ones by chunk (its sequence's m-block, as
    the preprocess finds it to zero a keyless chunk's rows)."""
    names = {c[0] for c in CONFIGS} | {f"{c[0]}_varlen" for c in VARLEN_CONFIGS}
    assert {name for name, *_ in counts} == names
    wrong = [(key, got) for key, got in counts.items() if got[0] != got[1]]
    assert not wrong, wrong[:10]
    # the cases that matter occur: m-blocks no n-block visits, and partial ranges
    assert any(v == 0 for v, _ in counts.values())
    assert any(0 < v < -(-key[2] // 128) for key, (v, _) in counts.items() if "256" not in key[0])


def test_the_hosts_count_and_keyless_rows_agree_with_the_header(counts):
    padded = {key: got for key, got in counts.items() if not key[0].endswith("_varlen")}
    for (name, sq, sk, m), (visits, _) in padded.items():
        assert host.dq_contributors(stand_in(name), sq, sk, m) == visits, (name, sq, sk, m)
    for name, sq, sk in {key[:3] for key in padded}:
        kernel = stand_in(name)
        keyless = host.keyless_queries(kernel, sq, sk)
        block_m = kernel.backward.block_m
        visited = [counts[(name, sq, sk, m)][0] > 0 for m in range(-(-sq // block_m))]
        # the rows of the leading m-blocks that no n-block visits, and none after them
        first = visited.index(True) if any(visited) else len(visited)
        assert keyless == min(first * block_m, sq), (name, sq, sk)
        assert all(visited[first:]), (name, sq, sk)


# --- the knob ---------------------------------------------------------------------------


def fused(example: str, extra: str = "") -> str:
    text = (EXAMPLES / f"{example}.fa").read_text()
    head, block = text.split("backward {", 1)
    return head + "backward {\n    fused_convert on" + extra + block


def test_the_knob_is_read_printed_and_read_back():
    compiled = compile_source(fused("fa3_hopper"), FILE)
    bwd = compiled.kernel.backward
    assert bwd.fused_convert
    assert explain_data(compiled)["backward"]["settings"]["fused_convert"] is True
    assert (
        f"fused_convert on (dQ converted by the CTA that completes each m-block, no convert_dq up to {FUSED_CONVERT_MAX_QUERIES} queries)"
        in explain_text(compiled)
    )
    plain = compile_source((EXAMPLES / "fa3_hopper.fa").read_text(), FILE)
    assert "fused_convert" not in explain_data(plain)["backward"]["settings"]
    assert "fused_convert" not in explain_text(plain)
    # (fa3_hopper: dK, dV by TMA, V late)
    assert bwd.text().endswith(" fused_convert=on dkv=tma late_v=on")
    assert read_backward(bwd.text(), bwd.loc).fused_convert
    assert not compile_source(
        (EXAMPLES / "fa3_hopper.fa").read_text(), FILE
    ).kernel.backward.fused_convert


@pytest.mark.parametrize(
    "example, extra, why",
    [
        ("fa3_causal", "\n    deterministic on", "deterministic on"),
        (
            "fa3_causal",
            "\n    dq_lag off\n    dQ: rf -st.shared-> smem[warpgroup] -reduce.add-> gmem",
            "dQ staged",
        ),
    ],
)
def test_what_breaks_the_count_is_refused_at_the_key(example, extra, why):
    text = fused(example, extra)
    if "deterministic on" in extra:  # (the lag and red.add are refused with it too: say the rest)
        text = text.replace("    dq_lag     on\n", "    dq_lag     off\n")
    with pytest.raises(SpecError) as info:
        compile_source(text, FILE)
    found = [d for d in info.value.diagnostics if "fused_convert on" in d.message]
    assert found and why in found[0].message, [d.message for d in info.value.diagnostics]
    line = next(i for i, l in enumerate(text.split("\n"), 1) if "fused_convert on" in l)
    assert found[0].loc.line == line


def test_a_keep_modifier_is_refused_and_a_score_is_not():
    prefix = (EXAMPLES / "modifiers" / "prefix_lm.fa").read_text()
    text = prefix.replace("backward {", "backward {\n    fused_convert on", 1)
    with pytest.raises(SpecError, match="a keep modifier"):
        compile_source(text, FILE)
    alibi = (EXAMPLES / "modifiers" / "alibi_causal.fa").read_text()
    assert "\n  score " in alibi and "\n  keep " not in alibi
    text = alibi.replace("backward {", "backward {\n    fused_convert on", 1)
    assert compile_source(text, FILE).kernel.backward.fused_convert


@pytest.mark.parametrize("example", ["fa3_hopper", "fa3_causal", "fa3_hdim64", "fa3_hdim64_causal"])
def test_the_fused_kernels_build_without_spills(example):
    assert_no_spills(kernel_usages(compile_source(fused(example), FILE)))


# --- the host's launches ------------------------------------------------------------------


def launches(monkeypatch, example: str, seqlen_q: int, seqlen_k: int):
    """The launches of one backward call on CPU tensors (the host reads their shapes, strides
    and pointers; the tensor maps, which need a driver, are stood in for)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(host, "tensor_map", lambda *args: bytes(128))
    empty_like = torch.empty_like  # (the gradients NaN until written: what the host zeroes shows)
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))
    kernel = compile_source(fused(example), FILE).kernel
    d = kernel.config.head_dim
    q = torch.zeros(2, seqlen_q, 4, d, dtype=torch.bfloat16)
    k = torch.zeros(2, seqlen_k, 4, d, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, seqlen_q)
    dout = torch.ones_like(q)
    seen = []
    dq, _, _ = host.run(kernel, seen.append, q, k, k.clone(), q.clone(), lse, dout, None, 0.125)
    return kernel, seen, dq


def test_the_main_kernel_converts_up_to_the_threshold(monkeypatch):
    kernel, seen, dq = launches(monkeypatch, "fa3_hopper", 1000, 700)
    assert [l.suffix for l in seen] == ["_preprocess", ""]
    assert dq.isnan().all()  # (no mask: every row is some CTA's to convert)
    params = seen[1].params
    assert len(params) == host.MAIN_BYTES
    pointer, *strides = host.FUSED.unpack_from(params, host.FUSED_OFFSET)
    assert pointer == dq.data_ptr() and tuple(strides) == (dq.stride(0), dq.stride(1), dq.stride(2))
    semaphore = struct.unpack_from("<Q", params, 4 * 128 + 5 * 8)[0]
    assert semaphore != 0  # the counters, zeroed by the preprocess
    kernel, seen, dq = launches(monkeypatch, "fa3_hopper", FUSED_CONVERT_MAX_QUERIES + 1, 700)
    assert [l.suffix for l in seen] == ["_preprocess", "", "_convert_dq"]
    assert host.FUSED.unpack_from(seen[1].params, host.FUSED_OFFSET) == (0, 0, 0, 0)


def test_rows_no_cta_converts_are_zeroed_by_the_host(monkeypatch):
    """Causal with seqlen_q > seqlen_k: the leading queries see no key, and no n-block visits
    their m-blocks (B_r 80: 1000 queries, 333 keys, so queries below 667 see none)."""
    kernel, seen, dq = launches(monkeypatch, "fa3_causal", 1000, 333)
    keyless = host.keyless_queries(kernel, 1000, 333)
    # queries below 667 see no key; m-blocks 0..7 (80 rows) hold only such, m-block 8 some
    # with keys, so its other rows are converted from their zero sums
    assert keyless == 640
    assert (dq[:, :keyless] == 0).all() and dq[:, keyless:].isnan().all()
    assert [l.suffix for l in seen] == ["_preprocess", ""]


# --- the header against the plan ------------------------------------------------------------

HEADERS = ROOT / "emit" / "sm90" / "include" / "fadsl"
CALL = re.compile(r"\b([A-Za-z_][A-Za-z_0-9]*(?:<[^<>();]*>)?)\s*\(")


def body(text: str, name: str) -> str:
    """The body of function ``name`` (the first definition) in ``text``."""
    start = text.index("{", re.search(rf"\b{name}\s*\(", text).end())
    depth = 0
    for at in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[at], 0)
        if depth == 0:
            return text[start + 1 : at]
    raise AssertionError(name)


def calls(text: str, known: set[str]) -> list[str]:
    """The calls among ``known`` in ``text``, in order, comments left out."""
    text = re.sub(r"//[^\n]*", "", text)
    return [m[1] for m in CALL.finditer(text) if m[1] in known]


def test_bwd_finish_dq_makes_the_plans_calls_in_its_order():
    """The header's own calls (bwd_convert_m_block inlined) are the plan's, in order; the
    meeting is every consumer thread's on a barrier id no other backward barrier takes."""
    plan = finish_plan(2)
    expected = [c.header_call for c in plan if c.header_call]
    known = set(expected) | {"bwd_convert_m_block<Cfg>", "red_add_dq<Cfg>", "red_add_v4_f32"}
    convert = (HEADERS / "sm90_bwd_convert.cuh").read_text()
    prep = (HEADERS / "sm90_bwd_prep.cuh").read_text()
    found = []
    for call in calls(body(convert, "bwd_finish_dq"), known):
        found += (
            calls(body(prep, "bwd_convert_m_block"), known)
            if call == "bwd_convert_m_block<Cfg>"
            else [call]
        )
    assert found == expected
    assert finish_problems(plan, 2) == []
    meeting = re.findall(r"named_bar_sync\(([^;]*)\);", body(convert, "bwd_finish_dq"))
    assert meeting == ["Cfg::kBarFinish, Cfg::kConsumerThreads"]
    config = (HEADERS / "sm90_bwd.cuh").read_text()
    ids = {
        name: int(v) for name, v in re.findall(r"static constexpr int (kBar\w+) = (\d+);", config)
    }
    taken = {1} | {ids["kBarDQ"] + w for w in range(3)} | {ids["kBarDqFull"] + w for w in range(3)}
    taken |= {ids["kBarDqEmpty"] + w for w in range(3)}
    assert ids["kBarFinish"] not in taken and 0 < ids["kBarFinish"] < 16


def test_packed_calls_convert_in_the_main_kernel_up_to_the_threshold(monkeypatch):
    """With packed sequences the host knows no sequence's length, only the tokens, which bound
    them: up to the threshold the main kernel converts, and the preprocess zeroes the keyless
    chunks' rows (bwd_keyless_chunk), so the host zeroes none; past it, convert_dq."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(host, "tensor_map", lambda *args: bytes(128))

    def no_host_zeroing(*args):
        raise AssertionError("the host zeroes rows of a packed call")

    monkeypatch.setattr(host, "keyless_queries", no_host_zeroing)
    text = (EXAMPLES / "serving" / "fa3_varlen_causal.fa").read_text()
    kernel = compile_source(
        text.replace("backward {", "backward {\n    fused_convert on", 1), FILE
    ).kernel
    for tokens, suffixes in (
        (FUSED_CONVERT_MAX_QUERIES, ["_preprocess", ""]),
        (FUSED_CONVERT_MAX_QUERIES + 1, ["_preprocess", "", "_convert_dq"]),
    ):
        q = torch.zeros(tokens, 4, 128, dtype=torch.bfloat16)
        k = torch.zeros(300, 2, 128, dtype=torch.bfloat16)
        cu_q = torch.tensor([0, tokens - 50, tokens], dtype=torch.int32)
        cu_k = torch.tensor([0, 100, 300], dtype=torch.int32)
        lse = torch.zeros(4, tokens)
        seen = []
        dq, _, _ = host.run_varlen(
            kernel, seen.append, q, k, k.clone(), q.clone(), lse, q.clone(), None, cu_q, cu_k, 0.1
        )
        assert [l.suffix for l in seen] == suffixes
        pointer, *strides = host.FUSED.unpack_from(seen[1].params, host.FUSED_OFFSET)
        fused = len(suffixes) == 2
        assert (pointer == dq.data_ptr()) == fused and pointer == (dq.data_ptr() if fused else 0)


def test_the_fused_kernels_machine_code_keeps_the_plans_orders():
    """What the plan's calls become in ptxas's SASS (NVRTC, fa3_hopper bf16), so that a wrapper
    whose asm lost its ordering (a relaxed atomic, a load through L1) fails here: each
    consumer thread's MEMBAR.GPU before the meeting on barrier 11 of 256 threads; after it the
    count an atomic add at GPU scope between a MEMBAR.GPU (release) and an L1 invalidation
    (acquire); every load after the meeting at GPU scope (L2), and no dQ add after it."""
    compiler, name = find_compiler()
    tool = nvdisasm()
    if compiler is None or tool is None:
        pytest.skip("needs NVRTC and nvdisasm")
    compiled = compile_source(fused("fa3_hopper"), FILE)
    source = next(s for s in render_backward(compiled.kernel, target_of(compiled.kernel), FILE)
                  if s.kernel_name.endswith("bf16"))  # fmt: skip
    cubin = compile_cubin(source.text, source.filename, source.kernel_name, "sm_90a", Path("/tmp"))
    sass = disassemble(cubin.cubin, tool)
    main = function(sass, source.kernel_name)
    code = [
        line.split("*/", 1)[1].strip()
        for line in main.splitlines()
        if re.search(r"/\*[0-9a-f]{4}\*/", line)
    ]
    meeting = [i for i, c in enumerate(code) if re.match(r"BAR\.SYNC\S* 0xb, 0x100\b", c)]
    assert len(meeting) == 1, meeting
    at = meeting[0]
    assert any("MEMBAR" in c and "GPU" in c for c in code[at - 8 : at]), code[at - 8 : at]
    after = code[at + 1 :]
    atomics = [i for i, c in enumerate(after) if c.startswith("ATOMG") and ".ADD" in c]
    assert atomics and all("GPU" in after[i] for i in atomics), [after[i] for i in atomics]
    count = atomics[0]
    assert any("MEMBAR" in c and "GPU" in c for c in after[max(0, count - 4) : count])
    assert any(c.startswith("CCTL.IVALL") for c in after[count + 1 : count + 4])
    loads = [c for c in after if c.startswith("LDG")]
    assert loads and all("STRONG.GPU" in c for c in loads), loads
    assert not any(c.startswith("RED") for c in after)
