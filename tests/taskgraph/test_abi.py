"""The ABI: one definition in Python, a generated C++ header that matches it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mpk_dist.taskgraph import abi
from mpk_dist.taskgraph.tasks import BY_NAME, KINDS
from mpk_dist.taskgraph.tasks.base import f2i, i2f


def test_opcodes_are_dense_and_names_unique():
    assert [k.opcode for k in KINDS] == list(range(len(KINDS)))
    for k in KINDS:
        assert len({a.name for a in k.args}) == len(k.args), k.name
        assert len({p.name for p in k.params}) == len(k.params), k.name
        assert k.doc and all(a.doc for a in k.args) and all(p.doc for p in k.params), k.name


def test_header_has_every_constant_with_its_value():
    h = abi.render_cuda_abi_header()
    assert h == abi.render_cuda_abi_header()  # deterministic
    consts = dict(re.findall(r"constexpr int (\w+) = (-?\d+);", h))
    for prefix, cols in (("TASK", abi.TASK_COLS), ("EVENT", abi.EVENT_COLS), ("WAIT", abi.WAIT_COLS),
                         ("SIGNAL", abi.SIGNAL_COLS), ("ARG", abi.ARG_COLS), ("BUFFER", abi.BUFFER_COLS)):
        for name, idx in cols.items():
            assert int(consts[f"{prefix}_COL_{name}"]) == idx
    for k in KINDS:
        up = k.name.upper()
        assert f"OP_{up} = {k.opcode}," in h
        for i, a in enumerate(k.args):
            assert int(consts[f"{up}_ARG_{a.name}"]) == i
        for i, p in enumerate(k.params):
            assert int(consts[f"{up}_PARAM_{p.name}"]) == i
        assert int(consts[f"{up}_NUM_ARGS"]) == len(k.args)
    assert consts["LINEAR_ARG_W"] == "1"
    assert int(consts["MPK_ABI_VERSION"]) == abi.ABI_VERSION


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_header_compiles_as_cpp(tmp_path: Path):
    src = tmp_path / "t.cpp"
    src.write_text(abi.render_cuda_abi_header() + "\nstatic_assert(mpk::OP_LINEAR == %d, \"\");\nint main() { return 0; }\n"
                   % BY_NAME["linear"].opcode)
    subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(src)], check=True, timeout=60)


def test_checked_in_header_matches_if_present():
    """If the CUDA side keeps a copy of the generated header, it must be the current one."""
    path = Path(__file__).resolve().parents[2] / "csrc" / "runtime" / "abi_generated.h"
    if path.is_file():
        assert path.read_text() == abi.render_cuda_abi_header(), f"{path} is stale: regenerate it"


def test_float_params_round_trip():
    for x in (1e-6, -0.125, 0.17677669, 1e30):
        assert i2f(f2i(x)) == pytest.approx(x, rel=1e-7)
    with pytest.raises(ValueError, match="parameter"):
        BY_NAME["rms_norm"].pack_params({"N": 4})
