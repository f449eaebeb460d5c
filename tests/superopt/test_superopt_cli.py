"""``mpk-dist superopt``: result on stdout, progress on stderr, one-line errors."""

from mpk_dist.cli import main

ARGS = ["superopt", "--pattern", "silu_mul_linear", "--shape", "M=2,I=256,N=64",
        "--max-kernel-ops", "1", "--max-block-ops", "3", "--processes", "1", "--no-cache"]


def test_cli_prints_best_graph_and_progress(capsys):
    assert main(ARGS) == 0
    out, err = capsys.readouterr()
    assert "best µGraph: 1 kernel op(s)" in out and "custom(A, B, W)" in out
    assert "explored=" in out and "z3_queries=" in out
    assert "superopt:" in err and "explored" in err


def test_cli_json(capsys):
    import json

    assert main([*ARGS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["pattern"] == "silu_mul_linear" and data["best"].startswith("µGraph")
    assert data["stats"]["verified"] == len(data["candidates"])


def test_cli_bad_shape_is_one_line(capsys):
    assert main(["superopt", "--pattern", "rmsnorm_linear", "--shape", "M=8,Q=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mpk-dist: error: superopt --shape for rmsnorm_linear: expected keys")
    assert "\n" not in err
    assert main(["superopt", "--pattern", "rmsnorm_linear", "--shape", "M8"]) == 2
    assert "expected NAME=INT" in capsys.readouterr().err
