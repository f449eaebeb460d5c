"""CPU test of scripts/sass_sizes.py (SASS instructions per function of a kernel binary) on a listing of the shape
``nvdisasm -c`` writes for the mega-kernel: the entry's label, then each non-inlined device function under a
``$kernel$mangled-name:`` label, local ``.L_x_N`` labels and directives between the instructions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

LISTING = """
        .type           mpk_megakernel,@function
mpk_megakernel:
.text.mpk_megakernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_1) ;
.L_x_1:
        /*0020*/                   CALL.REL.NOINC `($mpk_megakernel$_ZN3mpk3fooEi) ;
        /*0030*/                   EXIT ;
        .type           $mpk_megakernel$_ZN3mpk3fooEi,@function
        .size           $mpk_megakernel$_ZN3mpk3fooEi,($mpk_megakernel$_ZN3mpk3barEv - $mpk_megakernel$_ZN3mpk3fooEi)
$mpk_megakernel$_ZN3mpk3fooEi:
        /*0040*/                   STL [R1], R16 ;
        /*0050*/                   DMUL R2, R4, R6 ;
.L_x_2:
        /*0060*/                   LDL R16, [R1] ;
        /*0070*/                   RET.REL.NODEC R20 `(mpk_megakernel) ;
$mpk_megakernel$_ZN3mpk3barEv:
        /*0080*/              @P1 LDL.64 R2, [R1+0x8] ;
        /*0090*/                   RET.REL.NODEC R20 `(mpk_megakernel) ;
"""


def load_tool():
    path = Path(__file__).resolve().parents[2] / "scripts" / "sass_sizes.py"
    spec = importlib.util.spec_from_file_location("sass_sizes", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sass_sizes"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def test_functions_count_their_own_instructions_and_opcodes():
    tool = load_tool()
    funcs = {f.name: f for f in tool.parse(LISTING)}
    assert sorted(funcs) == ["_ZN3mpk3barEv", "_ZN3mpk3fooEi", "mpk_megakernel"]  # .L_x labels start none
    assert funcs["mpk_megakernel"].instructions == 4 and funcs["mpk_megakernel"].ops == {"CALL": 1}
    assert funcs["_ZN3mpk3fooEi"].instructions == 4
    assert funcs["_ZN3mpk3fooEi"].ops == {"STL": 1, "DMUL": 1, "LDL": 1}
    assert funcs["_ZN3mpk3barEv"].ops == {"LDL": 1} and funcs["_ZN3mpk3barEv"].bytes == 32  # predicated, .64


def test_report_filters_by_demangled_name_and_ranks_by_size():
    tool = load_tool()
    text = tool.report(tool.parse(LISTING), r"mpk::", 10)
    rows = text.splitlines()
    assert "mpk_megakernel" not in text  # its name does not match mpk::
    assert "mpk::foo(int)" in rows[1] and "mpk::bar()" in rows[2]  # larger first
    assert rows[-1].split()[0] == "6" and "2 function(s)" in rows[-1]


def test_missing_binary_is_a_clear_error(tmp_path):
    tool = load_tool()
    with pytest.raises(SystemExit, match="no such file .*expected a .cubin"):
        tool.main([str(tmp_path / "none.cubin")])
