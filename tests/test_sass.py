"""benchmarks/tools/sass.py on a hand-written SASS listing (no compiler needed): the main loop is the
shortest backward-branch span holding a GMMA, never a span through the kernel's EXIT (ptxas puts
an mbarrier wait's retry path after EXIT and branches back into the loop from there)."""
import pytest

from benchmarks.tools.sass import (common_path, local_memory_ops, loop_paths, main_loop, parse,
                                   predicated)

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0100*/                   HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ ;
        /*0110*/                   FFMA R2, R3, R4, R5 ;
        /*0120*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R6], R7 ;
        /*0130*/               @!P0 BRA 0x300 ;
        /*0140*/                   FMUL R8, R9, R10 ;
        /*0150*/                   ISETP.GE.AND P1, PT, R11, R12, PT ;
        /*0160*/                @P1 BRA 0x190 ;
        /*0170*/                   STL [R1], R8 ;
        /*0180*/                   LDL R8, [R1] ;
        /*0190*/                   HGMMA.64x64x16.F32 R24, gdesc[UR8], R24 ;
        /*01a0*/                @P2 BRA 0x100 ;
        /*01b0*/                   EXIT ;
        /*0300*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R6], R7 ;
        /*0310*/               @!P0 BRA 0x300 ;
        /*0320*/                   BRA 0x180 ;
"""


def test_main_loop_skips_the_retry_path_after_exit():
    instrs = parse(LISTING)
    assert [op.split(".")[0] for _, op, _ in instrs][:2] == ["MOV", "HGMMA"]
    loop = main_loop(instrs)
    # 0x180..0x320 is shorter than the loop and holds a GMMA, but runs through EXIT
    assert (loop[0][0], loop[-1][0]) == (0x100, 0x1A0)
    assert local_memory_ops(loop) == 2
    # the branch to the retry path leaves the loop (nothing skipped); the one at 0x160 skips
    # the spill pair: what every tile issues
    common = common_path(loop)
    assert [a for a, _, _ in common] == [0x100, 0x110, 0x120, 0x130, 0x140, 0x150, 0x160, 0x190,
                                         0x1A0]
    assert local_memory_ops(common) == 0


def test_loop_paths_take_both_ways_of_a_predicated_branch_inside_the_loop():
    instrs = parse(LISTING)
    loop = main_loop(instrs)
    assert predicated(LISTING) == {0x130, 0x160, 0x1A0, 0x310}
    paths = loop_paths(loop, predicated(LISTING))
    # @P1 BRA 0x190 skips the spill pair or not; @!P0 BRA 0x300 leaves the loop: not taken
    assert sorted(len(p) for p in paths) == [9, 11]
    assert [a for a, _, _ in min(paths, key=len)] == [a for a, _, _ in common_path(loop)]
    # an unconditional branch inside the loop is followed, the code it jumps over never runs
    jump = LISTING.replace("@P1 BRA 0x190", "BRA 0x190")
    assert [len(p) for p in loop_paths(main_loop(parse(jump)), predicated(jump))] == [9]


TINY_PTX = """
.version {v}
.target sm_90a
.address_size 64
.visible .entry tiny(.param .u64 out)
{{
    .reg .b64 %rd<2>;
    .reg .b32 %r<2>;
    ld.param.u64 %rd1, [out];
    mov.u32 %r1, 7;
    st.global.u32 [%rd1], %r1;
    ret;
}}
"""


def test_ptx_sass_lowers_a_newer_ptx_version():
    """tools/ptx_sass.assemble: a PTX header naming an ISA newer than the bundled ptxas reads (as
    CuTe DSL's kept PTX does) is lowered to the newest one it names, and the kernel assembles."""
    from tests._sm90 import gluon_available
    if not gluon_available():
        pytest.skip("triton's Gluon or its bundled ptxas is not available")
    from benchmarks.tools.ptx_sass import assemble
    sass, _ = assemble(TINY_PTX.format(v="99.9"))
    assert "EXIT" in sass and "STG" in sass
    with pytest.raises(RuntimeError):       # a real error still surfaces
        assemble(TINY_PTX.format(v="8.0").replace("mov.u32", "mov.bogus"))
