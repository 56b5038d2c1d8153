"""sm_80's checks of a spec: what mma.sync, cp.async and ldmatrix allow, with located errors.

- each warp owns whole 16-row mma tiles; each warp's share of a K/V tile is a whole
  number of 512-byte warp-wide cp.async rounds;
- the registers live at the peak of each mma fit the per-thread cap
  (``register_budget_fits``: a lower bound; fadsl.build.spill_check compiles and is the guard);
- a swizzle keeps the 16-byte chunks that cp.async and ldmatrix move whole and permutes
  spans that divide a row;
- paths: inputs gmem -cp.async-> smem -ldmatrix-> rf (V transposed), the output
  rf -st.shared-> smem -st.global-> gmem; Q and O warp-scoped, K and V CTA-scoped.
"""

from __future__ import annotations

from ...spec.checks import Checks, and_list
from ...ir import Instr, Level, RegLoad, Role, Scope, Swizzle, Tensor
from ...spec.syntax import PathDecl
from .caps import CAPABILITIES

# A conflict-free swizzle for each head_dim's rows: the 8 rows one ldmatrix reads land on
# 8 different 16-byte bank groups (96: FlashAttention's Swizzle<2, 3, 3>).
SWIZZLES = {64: "xor(3, 3, 3)", 96: "xor(2, 3, 3)", 128: "xor(3, 3, 4)", 256: "xor(3, 3, 5)"}


def validate(c: Checks, tensors: dict[Role, Tensor]) -> bool:
    """The cross-field checks, once every required setting is known."""
    v = c.values
    tile = v["tile"]
    block_r, block_c = tile["B_r"], tile["B_c"]
    warps, head_dim = v["warps"], v["head_dim"]
    ok = True
    if block_r % (16 * warps):
        c.error(
            c.key_locs["B_r"],
            f"B_r = {block_r} is not divisible by 16 x warps = {16 * warps}: "
            "each warp owns a whole number of 16-row mma tiles",
        )
        ok = False
    per_warp = block_c * head_dim * 2 // warps
    if block_c % warps or per_warp % 512:
        c.error(
            c.key_locs["B_c"],
            f"B_c = {block_c} with {warps} warps leaves each warp {per_warp} bytes of a K/V "
            "tile to copy, not a whole number of 512-byte warp-wide cp.async rounds",
        )
        ok = False
    rows = block_r // warps
    if ok and not register_budget_fits(c, tensors, rows, block_c, head_dim, warps):
        ok = False
    swizzle = v.get("swizzle")
    if isinstance(swizzle, Swizzle) and not swizzle_fits(c, swizzle, head_dim):
        ok = False
    if swizzle == "128B":
        c.error(
            c.key_locs["swizzle_value"],
            "swizzle 128B is the TMA/wgmma layout of target sm_90a; sm_80 takes 'none' or "
            "'xor(B, M, S)'",
        )
        ok = False
    stages = v.get("stages", 1)
    if stages > 1:
        c.error(
            c.key_locs["stages_value"],
            f"stages = {stages} is not supported yet (one K/V stage for now)",
        )
        ok = False
    if "window" in v:
        c.error(
            c.key_locs["window"],
            f"mask {v['window'].spelling(v['mask'])} is not built for sm_80 yet: a sliding "
            "window needs target sm_90a",
        )
        ok = False
    if c.decl.modifiers:
        c.error(
            c.decl.modifiers[0].loc,
            "score and keep modifiers are not built for sm_80 yet: they need target sm_90a",
        )
        ok = False
    for role in (Role.K, Role.V):
        tensor = tensors.get(role)
        if tensor is not None and tensor.smem_scope is Scope.WARP and warps > 1:
            c.error(
                c.scope_loc(role),
                f"{role.value}'s SMEM tile is declared warp-scoped, but every warp reads all "
                f"of it (each warp multiplies its query rows by all {block_c} keys): with "
                f"{warps} warps that is a race; declare smem[cta]",
            )
            ok = False
    for role in (Role.Q, Role.O):
        tensor = tensors.get(role)
        if tensor is not None and tensor.smem_scope is Scope.CTA:
            c.error(
                c.scope_loc(role),
                f"{role.value} in smem[cta] (a CTA-wide copy of the whole tile) is not "
                "supported yet; each warp moves its own rows: smem[warp]",
            )
            ok = False
    return ok


def register_budget_fits(
    c: Checks, tensors: dict[Role, Tensor], rows: int, block_c: int, head_dim: int, warps: int
) -> bool:
    """Registers per thread (4 bytes, 32 lanes) live at the peak of each mma step must fit
    the per-thread cap: 255, or 65536 / threads when a CTA's threads share fewer.

    A lower bound, deliberately: the fp32 accumulators of O (rows x head_dim) and of S
    (rows x B_c, through S = Q @ K^T), P in 16 bits (through O += P @ V), the softmax row
    statistics, Q's fragments when Q is held as a whole tile through the loop, and a k16
    slice of each other operand: ptxas issues a tile's ldmatrix just before the mma that
    reads it, so a tile loaded whole costs no more at the peak (measured: whole K and V
    tiles of B_c = 128 compile to 255 registers without spills). What else the compiler
    keeps live only it knows: fadsl.build.spill_check compiles the kernel and is the guard.
    """
    caps = CAPABILITIES
    threads = 32 * warps
    cap = min(caps.registers_per_thread, caps.registers_per_sm // threads)
    q_held = tensors.get(Role.Q) is None or tensors[Role.Q].reg_load is RegLoad.TILE
    o = ("O accumulators", rows * head_dim // 32)
    stats = ("softmax row statistics", rows // 4)
    q = ("Q fragments held through the loop", rows * head_dim // 64)
    phases = {
        "S = Q @ K^T": [
            o,
            ("S accumulators", rows * block_c // 32),
            q if q_held else ("a k16 slice of Q", rows // 4),
            ("a k16 slice of K", block_c // 4),
            stats,
        ],
        "O += P @ V": [
            o,
            ("P", rows * block_c // 64),
            ("a k16 slice of V", head_dim // 4),
            stats,
            *([q] if q_held else []),
        ],
    }
    step, parts = max(phases.items(), key=lambda kv: sum(n for _, n in kv[1]))
    need = sum(n for _, n in parts)
    if need <= cap:
        return True
    hint = "use a smaller B_c or more warps"
    if q_held:
        hint = "load Q fragment-wise (end Q's path in rf[frag]), or " + hint
    budget = f"the {cap}-register budget per thread"
    loc = c.key_locs["head_dim"]
    if cap < caps.registers_per_thread and need <= caps.registers_per_thread:
        budget = f"the {cap} registers per thread that {threads} threads allow"
        hint = f"use at most {caps.registers_per_sm // (32 * caps.registers_per_thread)} warps"
        loc = c.key_locs["warps"]
    listed = and_list(f"{what} ({n})" for what, n in parts)
    c.error(
        loc,
        f"head_dim {head_dim} with B_c = {block_c} and {rows} query rows per warp does not "
        f"fit {budget}: during '{step}', {listed} need {need}; {hint}",
    )
    return False


def swizzle_fits(c: Checks, swz: Swizzle, head_dim: int) -> bool:
    """The swizzle must keep 16-byte chunks whole and stay inside one row."""
    if swz.base < 3:
        c.error(
            swz.loc,
            f"xor(B, M, S) with M = {swz.base} splits the 16-byte chunks that cp.async and "
            "ldmatrix move (M must be at least 3 for 2-byte elements)",
        )
        return False
    if swz.shift < swz.bits:
        c.error(swz.loc, f"xor(B, M, S) needs S >= B, got S = {swz.shift}, B = {swz.bits}")
        return False
    # The XOR permutes elements inside aligned spans of 2^(M + B): when the span divides
    # the row, every row starts a span and is mapped onto itself (FlashAttention swizzles
    # head_dim 96 this way, in 32-element spans).
    span = 1 << (swz.base + swz.bits)
    if head_dim % span:
        fit = (head_dim & -head_dim).bit_length() - 1  # the largest M + B that divides
        if span > head_dim:
            why = f"wider than a {head_dim}-element row"
        else:
            why = f"which do not tile a {head_dim}-element row"
        c.error(
            swz.loc,
            f"xor({swz.bits}, {swz.base}, {swz.shift}) permutes spans of {span} elements, "
            f"{why} (need 2^(M + B) to divide {head_dim}: M + B <= {fit}, "
            f"e.g. {SWIZZLES[head_dim]})",
        )
        return False
    return True


def validate_path(c: Checks, role: Role, path: PathDecl, levels: list[Level], hops: list) -> bool:
    """The shape of one tensor's path: the levels it visits and the loads the mma needs."""
    where = path.tensor.loc
    if role is Role.O:
        if levels[0] is not Level.RF:
            c.error(
                path.levels[0].name.loc,
                "O is the output: its path starts in registers (rf), where the mma "
                f"accumulates it, not in {levels[0].value}",
            )
            return False
        if levels != [Level.RF, Level.SMEM, Level.GMEM]:
            c.error(where, "O must go rf -st.shared-> smem[...] -st.global-> gmem")
            return False
    else:
        if levels[0] is not Level.GMEM:
            c.error(
                path.levels[0].name.loc,
                f"{role.value} is an input: its path starts in gmem, not {levels[0].value}",
            )
            return False
        if Level.RF not in levels:
            c.error(
                path.levels[-1].name.loc,
                f"{role.value} never reaches registers (rf), where the mma reads its operands",
            )
            return False
        if levels[-1] is not Level.RF:
            c.error(
                path.levels[-1].name.loc,
                f"{role.value}'s path must end in rf: {role.value} must go "
                "gmem -cp.async-> smem[...] -ldmatrix-> rf",
            )
            return False
        if levels != [Level.GMEM, Level.SMEM, Level.RF]:
            c.error(where, f"{role.value} must go gmem -cp.async-> smem[...] -ldmatrix-> rf")
            return False
        want = Instr.LDMATRIX_TRANS if role is Role.V else Instr.LDMATRIX
        load = hops[1]
        if load.instr is not want:
            why = {
                Role.Q: "Q is the A operand of S = Q @ K^T, read row-major",
                Role.K: "K is the B operand of S = Q @ K^T; row-major K is K^T column-major",
                Role.V: "V is the B operand of O += P @ V and must be transposed on load",
            }[role]
            c.error(load.loc, f"{role.value} must be loaded with '{want.value}': {why}")
            return False
    return True
