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
        assert r["extra"]["read_bandwidth_after_gb_s"] > 0
        assert r["ratio_to_floor_strict"] >= r["ratio_to_floor"] * (1 - 1e-9)  # the floor at the higher sample
    assert "# OK" in text and "p50 ms" in text and "# read bandwidth after the runs" in text


def test_strict_ratio_uses_the_higher_bandwidth_sample():
    from mpk_dist.cli.commands.bench import _strict_ratios

    recs = [{"backend": "megakernel", "ms_per_token_p50": 6.0, "extra": {}}]
    # 15 GB at 3.0 TB/s before = 5 ms floor; 3.2 TB/s after = 4.6875 ms: the stricter floor
    line = _strict_ratios(recs, 15e9, 3.0e12, 3.2e12)
    assert abs(recs[0]["ratio_to_floor_strict"] - 6.0 / 4.6875) < 1e-12
    assert recs[0]["extra"]["read_bandwidth_after_gb_s"] == 3200.0
    assert "+6.7%" in line and "megakernel 1.280" in line
    _strict_ratios(recs, 15e9, 3.2e12, 3.0e12)  # a lower sample after: the one before stays the floor's
    assert abs(recs[0]["ratio_to_floor_strict"] - 6.0 / 4.6875) < 1e-12


def test_bandwidth_sample_warms_up_first():
    import time

    import torch

    from mpk_dist.bench.runner import measure_read_bandwidth

    t0 = time.perf_counter()
    bw = measure_read_bandwidth(torch.device("cpu"), repeats=1, warmup_s=0.3)
    assert time.perf_counter() - t0 >= 0.3 and bw > 0


def test_replica_grouping():
    assert ranks_per_replica(2, "ipc", ["megakernel"]) == 2
    assert ranks_per_replica(2, "local", ["megakernel"]) == 1
    assert ranks_per_replica(4, "local", ["torch", "torch-graph"]) == 4
    assert ranks_per_replica(1, "ipc", ["megakernel"]) == 1


def test_floor_is_per_gpu_when_each_rank_is_a_process():
    """ipc (or torch under MPI) spreads a replica over min(tp, GPUs) HBMs; local keeps it on one."""
    from mpk_dist.cli.commands.bench import gpus_per_replica

    assert gpus_per_replica(2, "ipc", ["megakernel"], world_size=2, visible_gpus=2) == 2
    assert gpus_per_replica(4, "ipc", ["megakernel"], world_size=4, visible_gpus=2) == 2  # 2 ranks per GPU (MPS)
    assert gpus_per_replica(2, "local", ["megakernel"], world_size=1, visible_gpus=2) == 1
    assert gpus_per_replica(2, "local", ["torch-graph"], world_size=2, visible_gpus=8) == 2  # torch.distributed
    assert gpus_per_replica(1, "ipc", ["megakernel"], world_size=2, visible_gpus=2) == 1  # --dp replicas of tp 1


def test_torch_records_say_nccl_under_mpi():
    from mpk_dist.cli.commands.bench import transport_label

    assert transport_label("megakernel", "ipc", 2) == "ipc"
    assert transport_label("torch-graph", "ipc", 2) == "nccl"
    assert transport_label("torch-graph", None, 1) == "local"
    assert transport_label("megakernel", None, 1) == "local"
