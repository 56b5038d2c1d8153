"""sm_80's checks of a spec: what mma.sync, cp.async and ldmatrix allow, with located errors.

- each warp owns whole 16-row mma tiles; each warp's share of a K/V tile is a whole
  number of 512-byte warp-wide cp.async rounds;
- the registers live through each mma fit the per-thread budget
  (``register_budget_fits``: an estimate; nvcc's 0-spill check is the real guard);
- a swizzle keeps the 16-byte chunks that cp.async and ldmatrix move whole;
- paths: inputs gmem -cp.async-> smem -ldmatrix-> rf (V transposed), the output
  rf -st.shared-> smem -st.global-> gmem; Q and O warp-scoped, K and V CTA-scoped.
"""

from __future__ import annotations

from ...checks import Checks, and_list
from ...ir import Instr, Level, RegLoad, Role, Scope, Swizzle, Tensor
from ...syntax import PathDecl
from .caps import CAPABILITIES


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
    if ok and not register_budget_fits(c, tensors, rows, block_c, head_dim):
        ok = False
    swizzle = v.get("swizzle")
    if isinstance(swizzle, Swizzle) and not swizzle_fits(c, swizzle, head_dim):
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
    c: Checks, tensors: dict[Role, Tensor], rows: int, block_c: int, head_dim: int
) -> bool:
    """Registers per thread (4 bytes, 32 lanes) live through each mma must fit the budget.

    An estimate, deliberately simple: the larger of the two mma steps' operands and
    accumulators, plus Q's fragments for the whole loop when Q is loaded as a tile. A
    tile loaded fragment-wise costs one k16 slice. (nvcc's 0-spill check is the real guard.)
    """

    def whole(role: Role) -> bool:
        tensor = tensors.get(role)
        return tensor is None or tensor.reg_load is RegLoad.TILE

    def operand(role: Role, tile_rows: int, slice_regs: int) -> tuple[str, int]:
        if whole(role):
            return f"the whole {role.value} tile", tile_rows * head_dim // 64
        return f"a k16 slice of {role.value}", slice_regs

    o = ("O accumulators", rows * head_dim // 32)
    q = operand(Role.Q, rows, rows // 4)
    phases = {
        "S = Q @ K^T": [o, q, operand(Role.K, block_c, block_c // 4)],
        "O += P @ V": [o, ("P", rows * block_c // 64), operand(Role.V, block_c, head_dim // 4)],
    }
    if whole(Role.Q):
        phases["O += P @ V"].append(("Q fragments held through the loop", q[1]))
    step, parts = max(phases.items(), key=lambda kv: sum(n for _, n in kv[1]))
    need = sum(n for _, n in parts)
    if need <= CAPABILITIES.registers_per_thread:
        return True
    tiles = [r.value for r in (Role.Q, Role.K, Role.V) if whole(r)]
    hint = "use a smaller B_c or more warps"
    if tiles:
        paths = f"{tiles[0]}'s path" if len(tiles) == 1 else f"the paths of {and_list(tiles)}"
        hint = f"load fragment-wise (end {paths} in rf[frag]), or " + hint
    listed = and_list(f"{what} ({n})" for what, n in parts)
    c.error(
        c.key_locs["head_dim"],
        f"head_dim {head_dim} with B_c = {block_c} and {rows} query rows per warp does not "
        f"fit the {CAPABILITIES.registers_per_thread}-register budget per thread: during '{step}', "
        f"{listed} need {need}; {hint}",
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
    if head_dim & (head_dim - 1):
        c.error(swz.loc, f"a swizzle needs rows of a power-of-two length, not {head_dim}")
        return False
    if swz.base + swz.bits > head_dim.bit_length() - 1:
        c.error(
            swz.loc,
            f"xor({swz.bits}, {swz.base}, {swz.shift}) permutes spans of "
            f"{1 << (swz.base + swz.bits)} elements, wider than a {head_dim}-element row "
            f"(need M + B <= {head_dim.bit_length() - 1})",
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
