"""``mpk-dist bench``: table, JSON records, and how data-parallel replicas are grouped."""

from __future__ import annotations

import json

from mpk_dist.cli import main
from mpk_dist.cli.commands.bench import ranks_per_replica


def test_bench_writes_one_record_per_backend(capsys, tmp_path):
    out = tmp_path / "r.json"
    code = main(["bench", "--model", "tiny", "--backend", "torch,interpreter", "--prompt-len", "4", "--output-len", "3",
                 "--iters", "1", "--warmup", "0", "--no-progress", "--output-json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    recs = json.loads(out.read_text())
    assert [r["backend"] for r in recs] == ["torch", "interpreter"]
    for r in recs:
        assert r["correct"] is True and r["floor_ms_per_token"] > 0 and r["ms_per_token_p50"] > 0
        assert len(r["decode_step_ms"]) == 2  # output_len - 1 decode steps after the prefill's token
    assert "# OK" in text and "p50 ms" in text


def test_replica_grouping():
    assert ranks_per_replica(2, "ipc", ["megakernel"]) == 2
    assert ranks_per_replica(2, "local", ["megakernel"]) == 1
    assert ranks_per_replica(4, "local", ["torch", "torch-graph"]) == 4
    assert ranks_per_replica(1, "ipc", ["megakernel"]) == 1
