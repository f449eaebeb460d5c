"""``mpk-dist run``: the CLI contract and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mpk_dist.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_contract_and_logits_dump(capsys, tmp_path, hf_models):
    ckpt, _ = hf_models["qwen3-tied"]
    dump = tmp_path / "logits.npy"
    code, out, _ = _run(capsys, "run", "--model", str(ckpt), "--backend", "torch", "--prompt-ids", "1,2,3",
                        "--max-new-tokens", "5", "--json", "--dump-logits", str(dump), "--tp", "2")
    assert code == 0
    res = json.loads(out)
    for key in ("tokens", "text", "per_token_ms", "prefill_ms", "backend", "tp"):
        assert key in res
    assert len(res["tokens"]) == 5 and len(res["per_token_ms"]) == 4 and res["tp"] == 2
    assert res["max_seq_len"] == 64  # sized from the context: 3 + 5 tokens, rounded up to 64
    logits = np.load(dump)
    assert logits.shape == (5, 256) and logits.dtype == np.float32
    assert logits.argmax(-1).tolist() == res["tokens"]


def test_force_tokens_changes_the_inputs(capsys, hf_models):
    ckpt, _ = hf_models["qwen3-tied"]
    base = ["run", "--model", str(ckpt), "--backend", "torch", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]
    _, free, _ = _run(capsys, *base)
    _, forced, _ = _run(capsys, *base, "--force-tokens", "9,9,9")
    a, b = json.loads(free)["tokens"], json.loads(forced)["tokens"]
    assert a[0] == b[0]  # the first token comes from the prompt alone
    assert a[1:] != b[1:]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "no-such-preset"], "expected a preset"),
    (["--model", "/nonexistent/dir/x"], "not a readable checkpoint"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,100000"], "out of range"),
    (["--max-new-tokens", "50000"], "expected at most the model's max_position_embeddings=40960"),
    (["--max-seq-len", "8", "--max-new-tokens", "16"], "expected at most --max-seq-len=8"),
    (["--tp", "3"], "tp values that work"),
    (["--backend", "tensorrt"], "--backend: expected one of"),
    (["--batch", "0"], "--batch: expected >= 1"),
])
def test_bad_input_one_line_error(capsys, argv, needle):
    code, out, err = _run(capsys, "run", "--backend", "torch", *argv) if "--backend" not in argv else _run(capsys, "run", *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpk-dist: error:") and needle in lines[0], err


def test_console_entry_point_reports_errors_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "mpk_dist", "run", "--model", "no-such-preset"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "expected a preset" in proc.stderr


def test_info_lists_backends(capsys):
    code, out, _ = _run(capsys, "info", "--json")
    assert code == 0 and "torch" in json.loads(out)["backends"]


@pytest.mark.parametrize("flag, needle", [(["--fuse"], "--fuse/--no-fuse: not an option of --backend torch"),
                                          (["--schedule", "aot"], "--schedule: not an option of --backend torch")])
def test_backend_specific_flags_are_refused_not_ignored(capsys, flag, needle):
    code, _, err = _run(capsys, "run", "--backend", "torch", *flag)
    assert code == 2 and needle in err and "interpreter" in err


def test_start_up_line_says_cold_or_warm(capsys, monkeypatch, hf_models):
    """A backend that reports its start-up (the mega-kernel's build_info) gets a line with the total and
    its parts, 'cold' when the kernel was compiled here, 'warm' from a cached cubin, '(cached)' after the task
    graph's time when its programs came from the disk cache."""
    import mpk_dist.engine as E

    real = E.build_backend

    def with_build_info(spec, model, cached):
        model, backend = real(spec, model)
        gen = backend.generate

        def generate(req):
            res = gen(req)
            res.extra.update(taskgraph_s=0.5, taskgraph_cached=cached, kernel_build_s=0.02 if cached else 41.0,
                             kernel_cached=cached, compiler="nvcc", load_s=0.1)
            return res
        backend.generate = generate
        return model, backend

    ckpt, _ = hf_models["qwen3-tied"]
    for cached, word, total, tg in ((False, "cold", "41.60", " |"), (True, "warm", "0.62", " (cached) |")):
        monkeypatch.setattr(E, "build_backend", lambda spec, model, c=cached: with_build_info(spec, model, c))
        code, out, _ = _run(capsys, "run", "--model", str(ckpt), "--backend", "torch", "--prompt-ids", "1,2",
                            "--max-new-tokens", "2")
        assert code == 0 and f"start-up {word} {total} s | task graph 0.50 s{tg}" in out, out
    monkeypatch.setattr(E, "build_backend", real)
    code, out, _ = _run(capsys, "run", "--model", str(ckpt), "--backend", "torch", "--prompt-ids", "1,2",
                        "--max-new-tokens", "2")
    assert code == 0 and "start-up" not in out  # the torch backend reports none
