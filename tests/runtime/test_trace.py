"""CPU tests of the trace export and ``mpk-dist trace-summary``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpk_dist.cli import main
from mpk_dist.models.presets import get_preset
from mpk_dist.runtime.params import TRACE_DTYPE, TRACE_MARKS
from mpk_dist.runtime.trace import chrome_trace, load_trace, summarize, write_trace
from mpk_dist.taskgraph.compiler import compile_rank_programs


def _records(tasks: list[tuple], marks: dict | None = None) -> np.ndarray:
    """(task, start, ready, end[, prep, post]) in ns -> TraceRecords; ``marks``: {row: phase marks in ns}."""
    marks = marks or {}
    return np.array([(t, 0, s, r - s, e - r, *rest, *(0,) * (2 - len(rest)), marks.get(i, (0,) * TRACE_MARKS))
                     for i, (t, s, r, e, *rest) in enumerate(tasks)], dtype=TRACE_DTYPE)


def test_chrome_trace_and_summary(tmp_path, capsys):
    cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=2, max_seq_len=16)[0]
    # worker 0 runs 0..3000 ns (two tasks), worker 1 waits 1000..1500 then runs 1500..2000 ns:
    # span 3 us; idle 0 and 2.5 us (0.5 us of it waiting)
    per_worker = [_records([(0, 1000, 1000, 2000), (1, 2000, 2000, 4000)]), _records([(2, 2000, 2500, 3000, 200, 100)])]
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
    kind2 = next(e["cat"] for e in evs if e["args"]["task"] == 2 and e["cat"] != "wait")
    n2 = sum(e["cat"] == kind2 for e in evs)  # task 2's kind may cover another task (prep/post 0)
    assert s["overheads"][kind2] == pytest.approx((0.2 / n2, 0.1 / n2))  # mean prep / post per task
    assert main(["trace-summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "op kind" in out and "embedding" in out and "idle" in out
    assert main(["trace-summary", "--json", str(path)]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["span_us"] == pytest.approx(3.0)
    assert next(k for k in js["kinds"] if k["kind"] == kind2)["prep_us_per_task"] == pytest.approx(0.2 / n2)


def test_trace_summary_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["trace-summary", str(bad)]) == 2
    assert "expected readable Chrome-trace JSON" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert main(["trace-summary", str(empty)]) == 2


def test_levels_view_of_one_step(tmp_path, capsys):
    """trace-summary --levels: per op of one step, span, start/end spread of its tiles and the gap after
    the previous op, from the events (two ops, the second's tiles start 0.5 and 1.5 us after the first ends)."""
    ev = lambda name, ts, dur, step=3: {"name": name, "cat": "linear", "ph": "X", "pid": 0, "tid": 0, "ts": ts,  # noqa: E731
                                         "dur": dur, "args": {"step": step}}
    evs = [ev("a", 0.0, 2.0), ev("a", 1.0, 2.0), ev("b", 3.5, 1.0), ev("b", 4.5, 1.0), ev("b", 0.0, 9.0, step=4)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": evs}))
    from mpk_dist.runtime.trace import levels

    rows = levels(load_trace(path), 3)
    assert [r["op"] for r in rows] == ["a", "b"] and rows[0]["gap_us"] is None
    assert rows[1]["gap_us"] == pytest.approx(0.5) and rows[1]["start_spread_us"] == pytest.approx(1.0)
    assert rows[0]["end_us"] == pytest.approx(3.0) and rows[1]["run_median_us"] == pytest.approx(1.0)
    assert main(["trace-summary", "--levels", "3", str(path)]) == 0 and "start spr" in capsys.readouterr().out
    assert main(["trace-summary", "--levels", "9", str(path)]) == 2
    assert "expected task events of step 9" in capsys.readouterr().err


def test_phase_marks_reach_the_events_and_the_levels(tmp_path, capsys):
    """A body's phase marks (csrc/runtime/trace_marks.cuh; ns after the run's start, 0 = not set) become
    ``mark<k>_us`` args of the task's event and per-op medians in the levels view, which prints their columns."""
    cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=2, max_seq_len=16)[0]
    per_worker = [_records([(0, 1000, 1000, 2000), (1, 2000, 2000, 4000)], marks={1: (300,) + (0,) * (TRACE_MARKS - 1)}),
                  _records([(2, 2000, 2500, 3000)])]
    evs = load_trace(write_trace(tmp_path / "t.json", chrome_trace(cg, per_worker)))
    runs = {e["args"]["task"]: e for e in evs if e["cat"] != "wait"}
    assert runs[1]["args"]["mark0_us"] == pytest.approx(0.3) and "mark1_us" not in runs[1]["args"]
    assert not any(k.startswith("mark") for k in runs[0]["args"])
    from mpk_dist.runtime.trace import format_levels, levels

    rows = {r["op"]: r for r in levels(evs, 0)}
    op1 = next(e["name"] for e in evs if e["args"]["task"] == 1 and e["cat"] != "wait")
    assert rows[op1]["mark_median_us"][0] == pytest.approx(0.3) and rows[op1]["mark_median_us"][1] is None
    table = format_levels(list(rows.values()))
    assert "mark0" in table and "mark1" not in table and "0.30" in table


def test_levels_show_each_ops_median_wait_and_prep(tmp_path):
    """The levels view gives per op the median of its tiles' waits (a tile that did not wait counts 0) and of the
    prefetch part of them (``prep_us``), from the same step only."""
    cg = compile_rank_programs(get_preset("tiny"), tp=1, batch=1, sms=2, max_seq_len=16)[0]
    # worker 0: task 0 waits 1000 ns (400 of it prep), task 1 none; worker 1: task 2 waits 3000 ns (prep 1000)
    per_worker = [_records([(0, 0, 1000, 2000, 400, 0), (1, 2000, 2000, 3000)]),
                  _records([(2, 0, 3000, 4000, 1000, 0)])]
    evs = load_trace(write_trace(tmp_path / "t.json", chrome_trace(cg, per_worker)))
    from mpk_dist.runtime.trace import format_levels, levels

    op_of = {e["args"]["task"]: e["name"] for e in evs if e["cat"] != "wait"}
    rows = {r["op"]: r for r in levels(evs, 0)}
    waits, preps = {0: 1.0, 1: 0.0, 2: 3.0}, {0: 0.4, 1: 0.0, 2: 1.0}
    for op, r in rows.items():
        mine = [t for t, name in op_of.items() if name == op]
        assert r["wait_median_us"] == pytest.approx(float(np.median([waits[t] for t in mine])))
        assert r["prep_median_us"] == pytest.approx(float(np.median([preps[t] for t in mine])))
    assert rows[op_of[2]]["wait_median_us"] >= 1.5  # task 2's 3 us wait is in its op's median
    assert "wait med" in format_levels(list(rows.values()))


def test_layer_profile_folds_the_layers_and_its_adds_sum_to_the_step(tmp_path, capsys):
    """trace-summary --levels also folds "L<i>.<op>" over the layers: per op the medians and the time it adds to the
    step's timeline (its last end minus the previous op's, 0 for an op that ends before it), summing to the step."""
    ev = lambda name, ts, dur: {"name": name, "cat": "linear", "ph": "X", "pid": 0, "tid": 0, "ts": ts,  # noqa: E731
                                "dur": dur, "args": {"step": 0}}
    # embedding 0-1; layer 0: qkv 1.5-3.5 (two tiles), attn 4-9; layer 1: qkv 10-12, attn 12.5-20;
    # a side op inside layer 1's attention (starts 13, ends 14: before attn's end) adds nothing; lm_head 21-30
    evs = [ev("embedding", 0.0, 1.0), ev("L0.qkv", 1.5, 2.0), ev("L0.qkv", 1.6, 1.0), ev("L0.attn", 4.0, 5.0),
           ev("L1.qkv", 10.0, 2.0), ev("L1.attn", 12.5, 7.5), ev("side", 13.0, 1.0), ev("lm_head", 21.0, 9.0)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": evs}))
    from mpk_dist.runtime.trace import layer_profile, levels

    prof = {p["op"]: p for p in layer_profile(levels(load_trace(path), 0))}
    assert list(prof) == ["embedding", "qkv", "attn", "side", "lm_head"]
    assert prof["qkv"]["layers"] == 2 and prof["embedding"]["layers"] == 0
    assert prof["qkv"]["adds_us"] == pytest.approx((3.5 - 1.0) + (12.0 - 9.0))
    assert prof["attn"]["adds_us"] == pytest.approx((9.0 - 3.5) + (20.0 - 12.0))
    assert prof["side"]["adds_us"] == 0.0 and prof["lm_head"]["adds_us"] == pytest.approx(10.0)
    assert prof["attn"]["span_median_us"] == pytest.approx(6.25) and prof["qkv"]["gap_median_us"] == pytest.approx(0.75)
    assert sum(p["adds_us"] for p in prof.values()) == pytest.approx(30.0)
    assert sum(p["share"] for p in prof.values()) == pytest.approx(1.0)
    # lag: the previous op's end -> the critical (last-ending) tile ready. qkv: layer 0's last tile (1.5-3.5) ready 0.5
    # after the embedding, layer 1's 1.0 after attn; attn 0.5 + 0.5; lm_head 1.0; the side op adds nothing, so no lag
    assert prof["qkv"]["lag_us"] == pytest.approx(0.5 + 1.0) and prof["attn"]["lag_us"] == pytest.approx(0.5 + 0.5)
    assert prof["side"]["lag_us"] == 0.0 and prof["lm_head"]["lag_us"] == pytest.approx(1.0)
    assert prof["embedding"]["lag_us"] == 0.0
    assert main(["trace-summary", "--levels", "0", str(path)]) == 0
    out = capsys.readouterr().out
    assert "op (over layers)" in out and "100.0%" in out and "lag (us)" in out


def test_layer_profile_lag_is_the_critical_tiles_readiness_not_the_first_tiles(tmp_path):
    """The lag follows the tile that ends last, not the first to start: an op whose early tile is ready at once but
    whose last-ending tile is ready 2 us after the previous op ends has a 2 us lag; one whose last-ending tile was ready
    before the previous op ended has none (its whole add is run)."""
    ev = lambda name, ts, dur: {"name": name, "cat": "linear", "ph": "X", "pid": 0, "tid": 0, "ts": ts,  # noqa: E731
                                "dur": dur, "args": {"step": 0}}
    # a 0-4; L0.b: a tile 4.1-5 and the critical one ready at 6, ends 7; L0.c: its last tile ready at 5 (before b's
    # end at 7: per-tile dependencies), ends 9
    evs = [ev("a", 0.0, 4.0), ev("L0.b", 4.1, 0.9), ev("L0.b", 6.0, 1.0), ev("L0.c", 5.0, 4.0), ev("L0.c", 7.5, 0.5)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": evs}))
    from mpk_dist.runtime.trace import layer_profile, levels

    rows = {r["op"]: r for r in levels(load_trace(path), 0)}
    assert rows["L0.b"]["last_ready_us"] == pytest.approx(6.0) and rows["L0.b"]["last_run_us"] == pytest.approx(1.0)
    prof = {p["op"]: p for p in layer_profile(list(rows.values()))}
    assert prof["b"]["adds_us"] == pytest.approx(3.0) and prof["b"]["lag_us"] == pytest.approx(2.0)
    assert prof["c"]["adds_us"] == pytest.approx(2.0) and prof["c"]["lag_us"] == 0.0


def test_levels_and_layer_profile_give_the_posts(tmp_path, capsys):
    """Each op's median post (the fence and signals after its tiles' bodies, TraceRecord.post_ns) per level and folded
    over the layers, in both tables; blank where the trace has none."""
    ev = lambda name, ts, dur, post: {"name": name, "cat": "linear", "ph": "X", "pid": 0, "tid": 0, "ts": ts,  # noqa: E731
                                      "dur": dur, "args": {"step": 0, **({} if post is None else {"post_us": post})}}
    evs = [ev("L0.a", 0.0, 2.0, 0.5), ev("L0.a", 0.1, 2.0, 0.9), ev("L0.a", 0.2, 2.0, 0.6), ev("L1.a", 3.0, 2.0, 0.7),
           ev("lm_head", 6.0, 4.0, None)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": evs}))
    from mpk_dist.runtime.trace import format_layer_profile, format_levels, layer_profile, levels

    rows = levels(load_trace(path), 0)
    by_op = {r["op"]: r for r in rows}
    assert by_op["L0.a"]["post_median_us"] == pytest.approx(0.6) and by_op["L1.a"]["post_median_us"] == pytest.approx(0.7)
    assert by_op["lm_head"]["post_median_us"] is None
    prof = {p["op"]: p for p in layer_profile(rows)}
    assert prof["a"]["post_median_us"] == pytest.approx(0.65) and prof["lm_head"]["post_median_us"] is None
    table = format_layer_profile(list(prof.values())).splitlines()
    assert "post med" in table[0] and "0.65" in table[1] and "post med" in format_levels(rows).splitlines()[0]
    assert main(["trace-summary", "--levels", "0", str(path)]) == 0
    assert "post med" in capsys.readouterr().out


def test_levels_and_layer_profile_give_each_ops_tail(tmp_path, capsys):
    """``tail_us``: how long an op's last tenth of tiles keep it open after the others ended (a wide level's time with
    fewer SMs streaming): 20 tiles ending at 1..19 us and one at 30 -> the last 2 (ceil(0.9 * 21) = 19th end at 19)
    keep it 11 us; per level and, folded, the median over the layers; 0 for a one-tile op."""
    ev = lambda name, dur: {"name": name, "cat": "linear", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0,  # noqa: E731
                            "dur": dur, "args": {"step": 0}}
    evs = [ev("L0.a", float(d)) for d in [*range(1, 21), 30]] + [ev("L1.a", float(d)) for d in range(1, 11)]
    evs.append({**ev("lm_head", 2.0), "ts": 40.0})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": evs}))
    from mpk_dist.runtime.trace import format_layer_profile, format_levels, layer_profile, levels

    by_op = {r["op"]: r for r in levels(load_trace(path), 0)}
    assert by_op["L0.a"]["tail_us"] == pytest.approx(30.0 - 19.0)
    assert by_op["L1.a"]["tail_us"] == pytest.approx(10.0 - 9.0)  # ceil(0.9 * 10) = 9th end
    assert by_op["lm_head"]["tail_us"] == 0.0
    prof = {p["op"]: p for p in layer_profile(list(by_op.values()))}
    assert prof["a"]["tail_median_us"] == pytest.approx(6.0)
    assert "tail" in format_levels(list(by_op.values())).splitlines()[0]
    table = format_layer_profile(list(prof.values())).splitlines()
    assert "tail med" in table[0] and " 6.00" in table[1]
    assert main(["trace-summary", "--levels", "0", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tail med" in out and "11.00" in out


def test_layer_profile_sets_each_op_against_its_bytes_at_the_bandwidth(tmp_path, capsys):
    """trace-summary --levels STEP --bandwidth GBS: each folded op gets its bytes in one layer (attention: the trace's
    cache bytes per position x the step's context; an op of several names by its part before '/'), its floor over
    its layers at that bandwidth and the time it adds above it; ops without bytes have a floor of 0."""
    ev = lambda name, ts, dur: {"name": name, "cat": "k", "ph": "X", "pid": 0, "tid": 0, "ts": ts,  # noqa: E731
                                "dur": dur, "args": {"step": 9}}
    # embedding 0-1; two layers of qkv_proj (2 us each) and attention/split (3 us each); lm_head 11-20
    evs = [ev("embedding", 0.0, 1.0), ev("L0.qkv_proj", 1.0, 2.0), ev("L0.attention/split", 3.0, 3.0),
           ev("L1.qkv_proj", 6.0, 2.0), ev("L1.attention/split", 8.0, 3.0), ev("lm_head", 11.0, 9.0)]
    meta = {"op_bytes": {"qkv_proj": 1_000_000, "lm_head": 4_000_000, "embedding": 0}, "kv_bytes_per_position": 1000}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": evs, "otherData": meta}))
    from mpk_dist.runtime.trace import format_layer_profile, layer_profile, levels, load_trace_with_meta, op_floor

    events, meta = load_trace_with_meta(path)
    assert events == load_trace(path) and meta == {**meta, "kv_bytes_per_position": 1000}
    floor = op_floor(meta, 9, 1000.0)  # 1000 GB/s: 1 MB takes 1 us
    assert floor["context"] == 10
    prof = {p["op"]: p for p in layer_profile(levels(events, 9), floor)}
    assert prof["qkv_proj"]["bytes"] == 1_000_000 and prof["qkv_proj"]["floor_us"] == pytest.approx(2.0)
    assert prof["qkv_proj"]["over_us"] == pytest.approx(prof["qkv_proj"]["adds_us"] - 2.0) == pytest.approx(2.0)
    assert prof["attention/split"]["bytes"] == 10_000 and prof["attention/split"]["floor_us"] == pytest.approx(0.02)
    assert prof["lm_head"]["floor_us"] == pytest.approx(4.0) and prof["lm_head"]["over_us"] == pytest.approx(5.0)
    assert prof["embedding"]["floor_us"] == 0.0
    table = format_layer_profile(list(prof.values())).splitlines()
    assert "floor (us)" in table[0] and "over (us)" in table[0]
    step = table[-1].split()
    assert float(step[-2]) == pytest.approx(6.0, abs=0.1) and float(step[-1]) == pytest.approx(14.0, abs=0.1)
    assert main(["trace-summary", "--levels", "9", "--bandwidth", "1000", str(path)]) == 0
    assert "over (us)" in capsys.readouterr().out
    assert main(["trace-summary", "--levels", "9", "--bandwidth", "1000", "--json", str(path)]) == 0
    js = json.loads(capsys.readouterr().out)
    assert {p["op"]: p["floor_us"] for p in js["layers"]}["lm_head"] == pytest.approx(4.0)


def test_bandwidth_needs_levels_and_a_trace_with_bytes(tmp_path, capsys):
    """--bandwidth without --levels, a trace without op bytes and a bandwidth <= 0 are clear errors (exit 2)."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"name": "L0.qkv_proj", "cat": "k", "ph": "X", "pid": 0, "tid": 0,
                                                 "ts": 0.0, "dur": 1.0, "args": {"step": 0}}]}))
    assert main(["trace-summary", "--bandwidth", "3000", str(path)]) == 2
    assert "expected with --levels" in capsys.readouterr().err
    assert main(["trace-summary", "--levels", "0", "--bandwidth", "3000", str(path)]) == 2
    assert "expected otherData.op_bytes" in capsys.readouterr().err
    path.write_text(json.dumps({"traceEvents": json.loads(path.read_text())["traceEvents"],
                                "otherData": {"op_bytes": {"qkv_proj": 1}}}))
    assert main(["trace-summary", "--levels", "0", "--bandwidth", "0", str(path)]) == 2
    assert "expected the read bandwidth" in capsys.readouterr().err
