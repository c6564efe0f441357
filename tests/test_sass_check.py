"""bench/sass.py's check on warpgroup MMAs, read on machine code shaped as ptxas writes it for sm_90a: a register
that an MMA in flight reads as its A operand, written before the wait that retires the MMA, is found, round the loop
too; one written after that wait is not."""

from __future__ import annotations

from bench.sass import wgmma_operand_hazards


def _kernel(body: list[str]) -> str:
    lines = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;", ".L_x_0:"]
    lines += [f"        /*{16 * (i + 1):04x}*/                   {line} ;" for i, line in enumerate(body)]
    lines.append("        /*ffff*/                   EXIT ;")
    return "\n".join(lines)


MMA0 = "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8], R24, gsb0"
MMA1 = "HGMMA.64x128x16.F32.BF16 R88, R168, gdesc[UR8], R88, gsb0"


def test_an_a_operand_rewritten_after_its_mma_is_retired_is_no_hazard():
    # two tiles a turn, as kernels/w4a16_wgmma.py overlaps them: each tile's operand is made again only after a wait
    # that leaves the other tile's MMA alone in flight
    body = [
        "HFMA2.BF16_V2 R152, R4, R5, R6", "WARPGROUP.ARRIVE", MMA0, "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "HFMA2.BF16_V2 R168, R4, R5, R6", "WARPGROUP.ARRIVE", MMA1, "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "@P0 BRA `(.L_x_0)",
    ]  # fmt: skip
    assert wgmma_operand_hazards(_kernel(body)) == []
    # without the first wait, tile 1's operand is made again while its MMA of the turn before may run
    body[3] = "NOP"
    found = wgmma_operand_hazards(_kernel(body))
    assert len(found) == 1 and "HFMA2.BF16_V2 R168" in found[0]


def test_an_a_operand_rewritten_while_its_mma_runs_is_found():
    sass = _kernel([
        "HFMA2.BF16_V2 R152, R4, R5, R6", "WARPGROUP.ARRIVE", MMA0,
        "LDS.128 R164, [R2]", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P0 BRA `(.L_x_0)",
    ])  # fmt: skip
    # a 128-bit load into R164..R167 lands in nothing the MMA reads; R152..R155 written at the top of the next turn
    # comes after the wait for every group
    assert wgmma_operand_hazards(sass) == []
    sass = _kernel([
        "HFMA2.BF16_V2 R152, R4, R5, R6", "WARPGROUP.ARRIVE", MMA0, "LDS.128 R152, [R2]",
        "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@P0 BRA `(.L_x_0)",
    ])  # fmt: skip
    assert len(wgmma_operand_hazards(sass)) == 1


def test_an_a_operand_rewritten_in_the_next_turn_of_the_loop_is_found():
    sass = _kernel([
        "HFMA2.BF16_V2 R154, R4, R5, R6", "WARPGROUP.ARRIVE", MMA0, "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "@P0 BRA `(.L_x_0)",
    ])  # fmt: skip
    # one tile a turn, its next operand made while its last MMA may still run
    found = wgmma_operand_hazards(sass)
    assert len(found) == 1 and "HFMA2.BF16_V2 R154" in found[0]
