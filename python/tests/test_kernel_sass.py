"""scripts/kernel_sass.py: the kernels' machine code read without a GPU. Its parsing on
cuobjdump's own layout, and, where scripts/test.sh installed cuobjdump and nvdisasm beside
NVRTC 13 (FO_TEST_NVRTC13_LIBRARY), the real CUBIN: every entry present, and the fast
arithmetic's entries with fewer division sites than the exact ones for the same formats
(fo_fast.cuh's point)."""
import os
import pathlib
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import kernel_sass  # noqa: E402

SASS = """
\tcode for sm_90
\t.target\tsm_90

\t\tFunction : fo_step_kernel_p7
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                    /* 0x00000a00ff017b82 */
                                                                             /* 0x000fe20000000800 */
        /*0010*/                   MUFU.RCP R6, R53 ;                        /* 0x0000003500067308 */
        /*0020*/                   FCHK P0, R50, R53 ;                       /* 0x000000353200... */
        /*0030*/              @!P0 BRA 0x280 ;                               /* 0x0000000000408947 */
        /*0040*/               @P0 CALL.REL.NOINC 0x6ec0 ;                   /* 0x0000006c00... */
\t\tFunction : fo_scale_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;                    /* 0x00000a00ff017b82 */
        /*10000*/                  EXIT ;                                    /* 0x000000000000794d */
"""

RES = """
Resource usage:
 Common:
  GLOBAL:192 CONSTANT[4]:384
 Function fo_scale_kernel:
  REG:30 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function fo_step_kernel_p7:
  REG:58 STACK:16 SHARED:3072 LOCAL:0 CONSTANT[0]:648 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_sass_is_counted_per_entry_with_predicated_ops_and_long_addresses():
    got = kernel_sass.parse_sass(SASS)
    assert got["fo_step_kernel_p7"] == {"instructions": 5, "FCHK": 1, "MUFU": 1, "CALL": 1}
    # an address past 0xffff has five digits: still one instruction
    assert got["fo_scale_kernel"] == {"instructions": 2, "FCHK": 0, "MUFU": 0, "CALL": 0}


def test_resource_usage_is_read_per_entry():
    assert kernel_sass.parse_resources(RES) == {"fo_scale_kernel": {"registers": 30, "stack": 0},
                                                "fo_step_kernel_p7": {"registers": 58, "stack": 16}}


def test_without_the_tools_it_says_so_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert kernel_sass.main(["libnvrtc.so", "--tools", str(tmp_path)]) == 2
    assert "no cuobjdump and nvdisasm" in capsys.readouterr().err


def test_a_virtual_architecture_is_refused():
    with pytest.raises(SystemExit):
        kernel_sass.main(["libnvrtc.so", "--arch", "compute_90"])


def test_the_real_cubin_has_every_entry_and_fast_divides_less():
    nvrtc = os.environ.get("FO_TEST_NVRTC13_LIBRARY")
    tools = kernel_sass.tools(kernel_sass.TOOLS)
    if not nvrtc or not os.path.exists(nvrtc) or tools is None:
        pytest.skip("needs FO_TEST_NVRTC13_LIBRARY and cuobjdump + nvdisasm (scripts/test.sh installs them)")
    rows = kernel_sass.table(nvrtc, "sm_90", tools)
    assert all(r["instructions"] > 0 and r["registers"] > 0 for r in rows.values()), rows
    # exact and fast quant8 AdamW over f32, bf16, bf16 + 24-bit masters (step_path.rs)
    for exact, fast in (("p3", "p6"), ("p4", "p7"), ("p5", "p8")):
        e, f = rows[f"fo_step_kernel_{exact}"], rows[f"fo_step_kernel_{fast}"]
        assert f["FCHK"] < e["FCHK"], (exact, e, fast, f)
