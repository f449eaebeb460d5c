"""Trace parsing, per-layer spans and the exposed-communication share."""

import json

import pytest

from mpk_dist.bench.trace import exposed_comm_share, is_comm, layer_spans, load_trace
from mpk_dist.errors import InputError


def _ev(ts, dur, sm, layer, op, pid=0):
    return {"ph": "X", "name": op, "ts": ts, "dur": dur, "tid": sm, "pid": pid, "args": {"layer": layer, "op": op}}


def test_load_list_or_object(tmp_path):
    events = [_ev(5, 1, 0, 0, "linear"), _ev(0, 2, 1, 0, "rms_norm"), {"ph": "B", "name": "x"}]
    (tmp_path / "a.json").write_text(json.dumps(events))
    (tmp_path / "b.json").write_text(json.dumps({"traceEvents": events}))
    for name in ("a.json", "b.json"):
        loaded = load_trace(tmp_path / name)
        assert [e.op for e in loaded] == ["rms_norm", "linear"]  # sorted by start, B events dropped
        assert loaded[0].sm == 1 and loaded[1].end == 6


def test_bad_traces(tmp_path):
    (tmp_path / "n.json").write_text(json.dumps([{"ph": "X", "name": "x", "ts": "soon", "dur": 1}]))
    with pytest.raises(InputError, match="expected trace events with numeric ts"):
        load_trace(tmp_path / "n.json")
    (tmp_path / "e.json").write_text("[]")
    with pytest.raises(InputError, match="got none"):
        load_trace(tmp_path / "e.json")


def test_layer_spans():
    events = [_ev(0, 4, 0, 0, "linear"), _ev(2, 5, 1, 0, "linear"), _ev(8, 2, 0, 1, "linear")]
    from mpk_dist.bench.trace import _event
    from pathlib import Path
    parsed = [_event(e, Path("t")) for e in events]
    assert layer_spans(parsed) == {0: (0.0, 7.0), 1: (8.0, 10.0)}


def test_exposed_comm_share():
    from mpk_dist.bench.trace import _event
    from pathlib import Path
    raw = [
        _ev(0, 10, 0, 0, "linear"),       # compute 0-10
        _ev(5, 10, 1, 0, "all_reduce"),   # comm 5-15: 10-15 exposed
        _ev(15, 5, 0, 1, "linear"),       # compute 15-20
        _ev(20, 0, 1, 1, "all_gather"),   # empty comm
    ]
    events = [_event(e, Path("t")) for e in raw]
    assert exposed_comm_share(events) == pytest.approx(5 / 20)
    # A second rank with fully hidden comm does not lower the worst rank's share.
    hidden = [_event(_ev(0, 20, 0, 0, "linear", pid=1), Path("t")), _event(_ev(5, 5, 1, 0, "all_reduce", pid=1), Path("t"))]
    assert exposed_comm_share(events + hidden) == pytest.approx(0.25)
    assert exposed_comm_share(hidden) == 0.0
    assert is_comm("all_reduce_tile") and not is_comm("linear")
