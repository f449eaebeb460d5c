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


def test_cli_compare_prune_prints_both_stats_and_the_verdict(capsys):
    assert main([*ARGS, "--compare-prune"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("prune"))
    on, off = lines[head + 1].split(), lines[head + 2].split()
    assert on[0] == "on" and off[0] == "off"
    assert int(on[2].replace(",", "")) > 0 and int(off[2].replace(",", "")) == 0  # pruned
    assert int(off[1].replace(",", "")) > int(on[1].replace(",", ""))            # explored
    assert on[-1] == off[-1]                                                     # best hash
    assert "best graphs equal: yes" in out and "custom(A, B, W)" in out
    assert "prune=on" in err and "prune=off" in err


def test_cli_compare_prune_json_and_counts(capsys):
    import json

    assert main([*ARGS, "--compare-prune", "--json", "--grid-counts", "64,32",
                 "--loop-counts", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["same_best"] is True and data["complete"] is True
    assert data["bounds"]["grid_counts"] == [32, 64] and data["bounds"]["loop_counts"] == [2]
    assert [r["prune"] for r in data["rows"]] == ["on", "off"]


def test_cli_compare_prune_errors_are_one_line(capsys):
    assert main([*ARGS, "--compare-prune", "--no-prune"]) == 2
    assert "expected at most one of --compare-prune and --no-prune" in capsys.readouterr().err
    assert main([*ARGS, "--grid-counts", "8,x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--grid-counts: expected positive integers" in err and "\n" not in err
