"""The merged table (plain, rich, CSV, Markdown) and the ``mpk-dist report`` command end to end."""

import csv
import io
import json

import pytest

from mpk_dist.bench.report import headers, plain_table, print_table, sort_records, to_markdown, write_csv
from mpk_dist.bench.results import build_result, write_result
from mpk_dist.cli import main


def _rec(model="tiny", backend="torch", tp=1, batch=1, step=2.0, correct=True):
    return build_result(model=model, tp=tp, batch=batch, backend=backend, transport="local", prompt_len=4,
                        output_len=3, prefill_ms=[5.0, 5.0], decode_step_ms=[step, step * 1.5] * 2,
                        floor_ms=1.0, exposed_comm_share=0.1, extra={"correct": correct})


@pytest.fixture
def records():
    return [_rec(tp=4, step=1.0), _rec(backend="interpreter", tp=2, step=9.0, correct=False),
            _rec(tp=1, batch=4), _rec(tp=2, step=1.5), _rec(model="qwen3-0.6b", tp=8, batch=16)]


def test_sort_order(records):
    keys = [(r["model"], r["backend"], r["tp"], r["batch"]) for r in sort_records(records)]
    assert keys == [("qwen3-0.6b", "torch", 8, 16), ("tiny", "interpreter", 2, 1),
                    ("tiny", "torch", 1, 4), ("tiny", "torch", 2, 1), ("tiny", "torch", 4, 1)]


def test_csv_round_trip(records, tmp_path):
    path = write_csv(records, tmp_path / "t.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 5 and list(rows[0]) == headers()
    tiny_tp4 = next(r for r in rows if r["model"] == "tiny" and r["tp"] == "4")
    assert float(tiny_tp4["p50 ms/tok"]) == pytest.approx(1.25)
    assert float(tiny_tp4["x floor"]) == pytest.approx(1.25)
    assert float(tiny_tp4["exposed comm %"]) == pytest.approx(10.0)
    assert {r["check"] for r in rows} == {"OK", "FAILED"}


def test_markdown_and_plain(records):
    md = to_markdown(records).splitlines()
    assert md[0].startswith("| model | backend |") and md[1].startswith("|---|---|---|---:")
    assert len(md) == 2 + 5
    interp = next(line for line in md if "interpreter" in line)
    assert "| 11.250 |" in interp and "| FAILED |" in interp  # p50 of steps 9, 13.5, 9, 13.5
    text = plain_table(records).splitlines()
    assert "p50 ms/tok" in text[0] and set(text[1]) <= {"-", " "} and len(text) == 7


def test_rich_table_renders(records):
    buf = io.StringIO()
    print_table(records, file=buf, use_rich=True)
    out = buf.getvalue()
    assert "mpk-dist results (5 runs)" in out and "FAILED" in out


def test_report_command(records, tmp_path, capsys):
    for i, rec in enumerate(records):
        write_result(rec, tmp_path / "results" / f"r{i}.json")
    trace = tmp_path / "trace.json"
    events = [{"ph": "X", "name": f"t{i}", "ts": 10.0 * i, "dur": 8.0, "tid": i % 4, "pid": 0,
               "args": {"layer": i // 8, "op": "all_reduce" if i % 8 == 7 else "linear"}} for i in range(32)]
    trace.write_text(json.dumps({"traceEvents": events + [{"ph": "M", "name": "meta"}]}))
    rc = main(["report", str(tmp_path / "results"), "--csv", str(tmp_path / "o.csv"),
               "--markdown", str(tmp_path / "o.md"), "--plots", str(tmp_path / "plots"),
               "--trace", str(trace), "--plain"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("tiny") >= 4 and "qwen3-0.6b" in out
    assert (tmp_path / "o.csv").read_text().count("\n") == 6
    assert (tmp_path / "o.md").read_text().startswith("| model")
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["latency_qwen3-0.6b.png", "latency_tiny.png", "timeline_trace.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert "32 tasks, 4 layers" in out


def test_report_bad_file_is_one_line_error(tmp_path, capsys):
    (tmp_path / "x.json").write_text("[1, 2]")
    assert main(["report", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected mpk-dist bench records" in err[0]
