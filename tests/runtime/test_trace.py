"""CPU tests of the trace export and ``mpk-dist trace-summary``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpk_dist.cli import main
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime.params import TRACE_DTYPE
from mpk_dist.runtime.trace import chrome_trace, load_trace, summarize, write_trace
from mpk_dist.taskgraph.compiler import compile_rank_programs


def _records(tasks: list[tuple[int, int, int, int]]) -> np.ndarray:
    """(task, start, ready, end) in ns -> TraceRecords."""
    return np.array([(t, 0, s, r - s, e - r) for t, s, r, e in tasks], dtype=TRACE_DTYPE)


def test_chrome_trace_and_summary(tmp_path, capsys):
    cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=2, max_seq_len=16)[0]
    # worker 0 runs 0..3000 ns (two tasks), worker 1 waits 1000..1500 then runs 1500..2000 ns:
    # span 3 us; idle 0 and 2.5 us (0.5 us of it waiting)
    per_worker = [_records([(0, 1000, 1000, 2000), (1, 2000, 2000, 4000)]), _records([(2, 2000, 2500, 3000)])]
    tr = chrome_trace(cg, per_worker, rank=0)
    path = write_trace(tmp_path / "t.json", tr)
    evs = load_trace(path)
    assert len(evs) == 4 and {e["tid"] for e in evs} == {0, 1} and sum(e["cat"] == "wait" for e in evs) == 1
    assert evs[0]["name"] == "step_begin" and evs[0]["ts"] == 0.0 and evs[1]["dur"] == 2.0
    s = summarize(evs)
    assert s["span_us"] == pytest.approx(3.0)
    busy = {pw[1]: (b, i, w) for pw, b, i, w in s["workers"]}
    assert busy[0] == pytest.approx((3.0, 0.0, 0.0)) and busy[1] == pytest.approx((0.5, 2.5, 0.5))
    assert sum(k[2] for k in s["kinds"]) == 3
    assert main(["trace-summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "op kind" in out and "embedding" in out and "idle" in out
    assert main(["trace-summary", "--json", str(path)]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["span_us"] == pytest.approx(3.0)


def test_trace_summary_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["trace-summary", str(bad)]) == 2
    assert "expected readable Chrome-trace JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert main(["trace-summary", str(empty)]) == 2
