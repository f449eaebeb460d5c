"""Workload files and the synthetic generator: parsing, seeding, one-line errors."""

from __future__ import annotations

import pytest

from mpk_dist.errors import InputError
from mpk_dist.serving.workload import WorkItem, load_requests, synthetic, write_requests


def test_jsonl_with_ids_and_lengths(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('# comment\n{"arrival_time": 0.5, "prompt_ids": [1, 2], "output_len": 3}\n\n'
                 '{"prompt_len": 5, "output_len": 2}\n')
    a = load_requests(f, vocab_size=100, seed=1)
    assert a[0] == WorkItem(0.5, (1, 2), 3)
    assert a[1].arrival_time == 0.0 and len(a[1].prompt_ids) == 5 and all(0 <= i < 100 for i in a[1].prompt_ids)
    assert load_requests(f, 100, seed=1) == a and load_requests(f, 100, seed=2)[1] != a[1]


@pytest.mark.parametrize("line, needle", [
    ('{"prompt_len": 5}', "output_len"),
    ('{"prompt_len": 5, "prompt_ids": [1], "output_len": 1}', "exactly one of"),
    ('{"prompt_ids": [1000], "output_len": 1}', "prompt_ids"),
    ('{"prompt_len": 2, "output_len": 1, "arrival_time": -1}', "arrival_time"),
    ('{"prompt_len": 2, "output_len": 1, "rate": 3}', "unknown"),
    ('[1, 2]', "JSON object"),
    ('{oops', "invalid JSON"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt_len": 1, "output_len": 1}\n' + line + "\n")
    with pytest.raises(InputError, match=needle) as exc:
        load_requests(f, vocab_size=100)
    assert "bad.jsonl:2" in str(exc.value)


def test_missing_or_empty_file(tmp_path):
    with pytest.raises(InputError, match="readable JSONL"):
        load_requests(tmp_path / "nope.jsonl", 10)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(InputError, match="at least one request"):
        load_requests(tmp_path / "e.jsonl", 10)


def test_synthetic_poisson_arrivals_and_round_trip(tmp_path):
    items = synthetic(200, rate=50.0, prompt_len=3, output_len=2, vocab_size=10, seed=0)
    times = [it.arrival_time for it in items]
    assert times == sorted(times) and times[0] == 0.0
    assert 2.0 < times[-1] < 6.0  # 199 gaps of mean 1/50 s
    assert all(t == 0.0 for t in (it.arrival_time for it in synthetic(5, float("inf"), 3, 2, 10)))
    write_requests(items, tmp_path / "s.jsonl")
    assert load_requests(tmp_path / "s.jsonl", 10) == items
    with pytest.raises(InputError, match="positive"):
        synthetic(0, 1.0, 3, 2, 10)
