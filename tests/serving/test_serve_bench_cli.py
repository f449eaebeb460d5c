"""``mpk-dist serve-bench`` (mpk_dist/cli/commands/serve_bench.py): report, JSON fields, --check."""

from __future__ import annotations

import json

import pytest

from mpk_dist.cli import main


def test_requests_file_report_and_json(capsys, tmp_path):
    wl = tmp_path / "w.jsonl"
    wl.write_text("\n".join(json.dumps(r) for r in [
        {"arrival_time": 0.0, "prompt_ids": [5, 6, 7, 8], "output_len": 6},
        {"arrival_time": 0.0, "prompt_len": 9, "output_len": 3},
        {"arrival_time": 0.03, "prompt_len": 2, "output_len": 5}]) + "\n")
    out_json = tmp_path / "r.json"
    code = main(["serve-bench", "--model", "tiny", "--requests", str(wl), "--max-batch", "2", "--page-size", "4",
                 "--check", "--ignore-eos", "--virtual-pass-ms", "10", "--percentiles", "50,99",
                 "--output-json", str(out_json), "--device", "cpu"])
    text = capsys.readouterr().out
    assert code == 0
    assert "Serving Benchmark Result" in text and text.count("  OK\n") == 3 and "# OK" in text
    rec = json.loads(out_json.read_text())
    for key in ("completed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p50_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "ttfts", "itls"):
        assert key in rec, key
    assert rec["completed"] == 3 and rec["output_lens"] == [6, 3, 5] and rec["correct"] == [True, True, True]
    # virtual clock, 10 ms per pass: the two first requests share pass 0 and emit their first token at 10 ms;
    # the third arrives at 30 ms but both slots are busy until request 1 (3 outputs) retires after pass 2
    assert rec["ttfts"][:2] == pytest.approx([0.01, 0.01])
    assert rec["ttfts"][2] == pytest.approx(0.01)
    assert rec["itls"][0] == pytest.approx([0.01] * 5)


def test_synthetic_and_errors(capsys, tmp_path):
    code = main(["serve-bench", "--synthetic", "3", "--prompt-len", "4", "--output-len", "2", "--rate", "100",
                 "--virtual-pass-ms", "5", "--device", "cpu"])
    assert code == 0 and "not checked" in capsys.readouterr().out
    assert main(["serve-bench", "--synthetic", "2", "--percentiles", "0,x", "--device", "cpu"]) == 2
    assert "--percentiles" in capsys.readouterr().err
    assert main(["serve-bench", "--synthetic", "2", "--backend", "megakernel", "--device", "cpu"]) == 2
    assert "serving backend" in capsys.readouterr().err


def test_persistent_passes_flag(capsys, tmp_path):
    """--persistent-passes reaches the interpreter backend (one launch serves several passes) and the
    run still equals each request alone; a negative P is refused."""
    out = tmp_path / "r.json"
    code = main(["serve-bench", "--model", "tiny", "--synthetic", "4", "--prompt-len", "6", "--output-len", "4",
                 "--backend", "interpreter", "--persistent-passes", "4", "--max-batch", "2",
                 "--max-tokens-per-step", "8", "--device", "cpu", "--check", "--virtual-pass-ms", "5",
                 "--output-json", str(out)])
    assert code == 0 and "OK" in capsys.readouterr().out
    rec = json.loads(out.read_text())  # one backend: one record
    assert rec["persistent_passes"] == 4 and rec["launches"] == -(-rec["passes"] // 4) < rec["passes"]
    assert main(["serve-bench", "--synthetic", "2", "--persistent-passes", "-1", "--device", "cpu"]) == 2
    assert "--persistent-passes: expected P >= 0" in capsys.readouterr().err
