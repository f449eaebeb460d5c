"""Bench records: field names shared with vLLM / SGLang, per-token statistics, replicas, files."""

import json

import numpy as np
import pytest

from mpk_dist.bench.results import (
    build_result,
    combine_replicas,
    load_results,
    percentile,
    write_result,
)
from mpk_dist.errors import InputError


def _record(**overrides):
    # 3 iterations of 4 decode steps; iteration i: prefill 10+i ms, steps 2,2,3,5 ms (+i).
    prefill = [10.0, 11.0, 12.0]
    steps = [v + i for i in range(3) for v in (2.0, 2.0, 3.0, 5.0)]
    kwargs = dict(model="tiny", tp=2, batch=4, backend="interpreter", transport="local", prompt_len=8,
                  output_len=5, prefill_ms=prefill, decode_step_ms=steps, floor_ms=1.5,
                  exposed_comm_share=0.25, extra={"correct": True})
    kwargs.update(overrides)
    return build_result(**kwargs)


def test_percentile_matches_numpy():
    values = [5.0, 1.0, 9.0, 2.5, 7.0, 3.3, 8.8]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_vllm_latency_fields():
    rec = _record()
    # Iteration latency = prefill + its 4 steps, in seconds.
    assert rec["latencies"] == pytest.approx([0.022, 0.027, 0.032])
    assert rec["avg_latency"] == pytest.approx(0.027)
    assert set(rec["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert rec["percentiles"]["50"] == pytest.approx(0.027)


def test_sglang_bench_one_batch_fields():
    rec = _record()
    assert rec["batch_size"] == 4 and rec["input_len"] == 8 and rec["output_len"] == 5
    assert rec["prefill_latency"] == pytest.approx(0.011)
    assert rec["prefill_throughput"] == pytest.approx(8 * 4 / 0.011)
    steps = sorted(v + i for i in range(3) for v in (2.0, 2.0, 3.0, 5.0))
    med = (steps[5] + steps[6]) / 2 / 1e3
    assert rec["median_decode_latency"] == pytest.approx(med)
    assert rec["median_decode_throughput"] == pytest.approx(4 / med)
    assert rec["total_latency"] == pytest.approx(0.027)
    assert rec["overall_throughput"] == pytest.approx((8 + 5) * 4 / 0.027)
    assert rec["run_name"] == "tiny_interpreter_local_tp2_b4"


def test_per_token_floor_and_environment():
    rec = _record()
    steps = [v + i for i in range(3) for v in (2.0, 2.0, 3.0, 5.0)]
    assert rec["ms_per_token_p50"] == pytest.approx(np.percentile(steps, 50))
    assert rec["ms_per_token_p90"] == pytest.approx(np.percentile(steps, 90))
    assert rec["ms_per_token_p99"] == pytest.approx(np.percentile(steps, 99))
    assert rec["ratio_to_floor"] == pytest.approx(rec["ms_per_token_p50"] / 1.5)
    assert rec["tokens_per_s"] == pytest.approx(4e3 / rec["ms_per_token_p50"])
    assert rec["exposed_comm_share"] == 0.25
    for key in ("gpu", "hostname", "date", "git_commit"):
        assert key in rec
    assert set(rec["versions"]) >= {"torch", "cuda", "nccl", "mpi", "mpk_dist"}
    assert rec["versions"]["torch"] is not None
    json.dumps(rec)  # everything serialises
    assert _record(floor_ms=None)["ratio_to_floor"] is None


def test_bad_inputs_are_refused():
    with pytest.raises(InputError, match="expected one prefill per iteration"):
        _record(decode_step_ms=[1.0] * 5)
    with pytest.raises(InputError, match="batch: expected a positive integer, got 0"):
        _record(batch=0)
    with pytest.raises(InputError, match="exposed_comm_share: expected a fraction"):
        _record(exposed_comm_share=1.5)


def test_combine_replicas_pools_timings():
    a = _record()
    b = _record(prefill_ms=[20.0, 20.0, 20.0], decode_step_ms=[10.0] * 12, exposed_comm_share=0.4)
    both = combine_replicas([a, b])
    assert both["dp_replicas"] == 2 and both["iters"] == 6
    assert both["ms_per_token_p99"] == pytest.approx(np.percentile(a["decode_step_ms"] + [10.0] * 12, 99))
    assert both["exposed_comm_share"] == 0.4
    assert both["tokens_per_s_total"] == pytest.approx(a["tokens_per_s"] + b["tokens_per_s"])
    assert [r["replica"] for r in both["replicas"]] == [0, 1]
    with pytest.raises(InputError, match="expected replicas of one point"):
        combine_replicas([a, _record(batch=8)])


def test_write_and_load(tmp_path):
    a, b = _record(), _record(tp=4)
    write_result(a, tmp_path / "r" / "a.json")
    write_result([b], tmp_path / "r" / "b.json")
    (tmp_path / "c.jsonl").write_text(json.dumps(a) + "\n" + json.dumps(b) + "\n")
    loaded = load_results([tmp_path / "r", tmp_path / "c.jsonl"])
    assert [r["tp"] for r in loaded] == [2, 4, 2, 4]
    assert loaded[0]["source_file"].endswith("a.json")
    assert not list((tmp_path / "r").glob(".*tmp"))


def test_load_refuses_foreign_json(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"avg_latency": 1.0}))
    with pytest.raises(InputError, match="x.json: expected mpk-dist bench records .* without model"):
        load_results([tmp_path / "x.json"])
    with pytest.raises(InputError, match="expected a result file or directory"):
        load_results([tmp_path / "missing.json"])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="bad.json: expected JSON"):
        load_results([tmp_path / "bad.json"])
