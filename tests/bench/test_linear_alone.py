"""CPU tests of ``mpk-dist bench-linear`` (mpk_dist.bench.linear_alone): the per-rank matrix shapes,
the refusal without a GPU, flag errors, and the table with fake timings."""

from __future__ import annotations

import pytest

from mpk_dist.bench import linear_alone as LA
from mpk_dist.cli import main
from mpk_dist.errors import InputError
from mpk_dist.models.presets import get_preset


def test_matrix_shapes_follow_the_megatron_split():
    """qwen3-8b (32 q heads, 8 kv heads, head dim 128, hidden 4096, intermediate 12288, vocab 151936)."""
    cfg = get_preset("qwen3-8b")
    assert LA.matrix_shapes(cfg, 1) == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                                        "down": (4096, 12288), "lm_head": (151936, 4096)}
    assert LA.matrix_shapes(cfg, 2) == {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (12288, 4096),
                                        "down": (4096, 6144), "lm_head": (75968, 4096)}
    assert LA.matrix_shapes(cfg, 16)["qkv"] == ((2 + 2 * 1) * 128, 4096), "one replicated KV head per rank"
    with pytest.raises(InputError, match="--tp: expected a divisor"):
        LA.matrix_shapes(cfg, 3)


def test_mma_cases_start_at_batch_2():
    opts = LA.BenchOptions(batches=[1, 4], variants=["scalar", "mma"])
    assert LA.cases(opts) == [(1, "scalar"), (4, "scalar"), (4, "mma")]


def _row(matrix, B, variant, us, ok=True, N=4096, K=4096):
    nbytes = LA.row_bytes(N, K, B, 2)
    return {"matrix": matrix, "N": N, "K": K, "batch": B, "variant": variant, "tiles": 128, "us": us,
            "gb_s": nbytes / us / 1e3, "rel_err": 3e-3 if ok else 0.5, "ok": ok}


def test_table_with_fake_timings():
    """Units in the header, % of the read bandwidth per row, a correctness column and an OK footer."""
    assert LA.row_bytes(4096, 4096, 8, 2) == 2 * 4096 * 4096 + 2 * 8 * 4096 + 2 * 8 * 4096
    rows = [_row("o", 8, "scalar", 40.0), _row("o", 8, "mma", 8.5)]
    text, ok = LA.format_table(rows, 4000.0, "# bench-linear test")
    lines = text.splitlines()
    assert ok and lines[0] == "# bench-linear test" and "4000.0 GB/s" in lines[1]
    assert "GB/s" in lines[2] and "%read" in lines[2] and "time us" in lines[2]
    mma = lines[4].split()
    assert mma[:5] == ["o", "4096", "4096", "8", "mma"] and mma[-1] == "OK"
    gbs = rows[1]["gb_s"]
    assert float(mma[7]) == pytest.approx(gbs, abs=0.05) and mma[8] == f"{100 * gbs / 4000:.1f}%"
    assert lines[-1].startswith("# OK: 2/2")
    bad, ok2 = LA.format_table(rows + [_row("down", 4, "mma", 9.0, ok=False)], 4000.0, "# x")
    assert not ok2 and bad.splitlines()[-2].endswith("FAILED") and bad.splitlines()[-1].startswith("# FAILED: 2/3")


def test_cli_refuses_without_a_gpu(capsys, monkeypatch):
    """On a machine without CUDA the command says so in one line and exits 2 (no traceback)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench-linear", "--batches", "4", "--matrices", "o"]) == 2
    err = capsys.readouterr().err
    assert "bench-linear: expected a CUDA GPU" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,msg", [
    (["--batches", "0,17"], "--batches: expected"), (["--threads", "300"], "--threads: expected one of"),
    (["--matrices", "qkv,mlp"], "--matrices: expected"), (["--variants", "tc"], "--variants: expected"),
    (["--unroll", "3"], "--unroll: expected"), (["--tp", "5"], "--tp: expected a divisor"),
])
def test_cli_flag_errors(capsys, argv, msg):
    assert main(["bench-linear", *argv]) == 2
    assert msg in capsys.readouterr().err
