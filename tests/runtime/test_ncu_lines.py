"""CPU test of scripts/ncu_lines.py (PC samples of an ``ncu --print-source cuda,sass`` export per source line) on
a small export of the shape ncu writes: per file a path row, a header row, then each source line's row followed
by the rows of its SASS instructions."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

HEADER = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","stall_long_sb","stall_no_inst","stall_long_sb (Not Issued)"')
EXPORT = "\n".join([
    '"File Path","/src/a.cuh"', '"Function Name","k"', HEADER,
    '"10","x = p.f;","-","-","40","30","30","10","25"',
    '"","","0x7f00","      LDG.E R1, [R2]","40","30","30","10","25"',
    '"11","y = 1;","-","-","0","0","0","0","0"',
    '"File Path","/src/b.cuh"', '"Function Name","k"', HEADER,
    '"5","call();","-","-","60","50","0","60","0"',
    '"","","0x7f10","      CALL.REL f","60","50","0","60","0"',
])


def load_tool():
    path = Path(__file__).resolve().parents[2] / "scripts" / "ncu_lines.py"
    spec = importlib.util.spec_from_file_location("ncu_lines", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lines_keep_the_source_rows_and_issued_and_unissued_stalls_apart(tmp_path):
    tool = load_tool()
    path = tmp_path / "export.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(EXPORT)
    lines = tool.read_lines(str(path))
    assert set(lines) == {("/src/a.cuh", 10), ("/src/a.cuh", 11), ("/src/b.cuh", 5)}, "SASS rows counted as lines"
    a10 = lines[("/src/a.cuh", 10)]
    assert a10[tool.SAMPLES] == 40 and a10["stall_long_sb"] == 30 and a10["stall_no_inst"] == 10
    assert "stall_long_sb (Not Issued)" not in a10, "the not-issued column replaced the all-samples one"
    assert lines[("/src/b.cuh", 5)]["_src"] == "call();"


def test_report_ranks_lines_by_samples(tmp_path, capsys, monkeypatch):
    tool = load_tool()
    path = tmp_path / "export.csv"
    path.write_text(EXPORT)
    monkeypatch.setattr("sys.argv", ["ncu_lines.py", str(path), "--top", "2"])
    tool.main()
    out = capsys.readouterr().out
    assert "100 samples" in out and "60.00%  /src/b.cuh" in out and "40.00%  /src/a.cuh" in out
    top = [l for l in out.splitlines() if l.strip().startswith(("60.00%", "40.00%")) and ":" in l.split()[1]]
    assert [l.split()[1] for l in top] == ["b.cuh:5", "a.cuh:10"], out
    assert "no_inst 100%" in top[0] and "long_sb 75%" in top[1], out
