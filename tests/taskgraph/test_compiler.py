"""Compiling whole models: ranks structurally identical, real shapes, and the ``compile`` command."""

from __future__ import annotations

import json
import time

import numpy as np

from mpk_dist.cli import main
from mpk_dist.models.presets import get_preset
from mpk_dist.taskgraph.compiler import compile_rank_programs
from mpk_dist.taskgraph.serialize import load


def test_ranks_share_structure_and_differ_in_slots():
    cgs = compile_rank_programs(get_preset("tiny"), 4, sms=8, max_seq_len=64)
    for cg in cgs[1:]:
        for k in ("tasks", "events", "waits", "signals", "worker_tasks"):
            np.testing.assert_array_equal(cg.arrays[k], cgs[0].arrays[k])
    assert not np.array_equal(cgs[1].arrays["args"], cgs[0].arrays["args"])  # receive-buffer slots


def test_qwen3_0_6b_shapes_compile_quickly():
    t0 = time.perf_counter()
    (cg,) = compile_rank_programs(get_preset("qwen3-0.6b"), 2, sms=132, max_seq_len=1024, ranks=[1])
    assert time.perf_counter() - t0 < 20  # ~1-2 s here; generous for a loaded CI machine
    kinds = {op["kind"] for op in cg.meta["ops"]}
    assert {"allreduce_push", "allreduce_reduce", "allgather_push", "argmax_select"} <= kinds
    assert cg.meta["num_layers"] == 28 and cg.num_tasks > 28 * 100


def test_compile_command_dumps_arrays_summary_and_picture(tmp_path, capsys):
    assert main(["compile", "--model", "tiny", "--tp", "2", "--sms", "8", "--dump", str(tmp_path), "--layer", "1"]) == 0
    assert "tasks" in capsys.readouterr().out
    for r in range(2):
        assert load(tmp_path / f"rank{r}").meta["rank"] == r
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["tasks"] == sum(v["tasks"] for v in summary["per_kind"].values())
    assert summary["per_layer"]["1"]["tasks"] > 0 and len(summary["task_bytes"]["rows"]) == summary["tasks"]
    dot = (tmp_path / "layer1.dot").read_text()
    assert dot.startswith('digraph "layer 1"') and '{ label="L1.o_proj' in dot and '{ label="L0.' not in dot
    assert "MPK_ABI_VERSION" in (tmp_path / "abi.h").read_text()
    assert main(["compile", "--model", "tiny", "--tp", "3", "--dump", str(tmp_path / "x")]) == 2  # does not divide
