"""GPU + MPI tests of the mega-kernel's ``--transport ipc``: one process per rank, started by
launch/mpirun.sh (a private MPS daemon when ranks share a GPU: on a one-GPU machine, always).
Each rank runs tests/runtime/ipc_job.py; rank 0 leaves logits/tokens in a temporary directory and
every rank prints one JSON line. Run by ``scripts/gpu_check.sh --tp`` in its own pytest process.

NOTE: every mpirun job runs (module fixture) BEFORE this process touches CUDA for the torch
references, so no CUDA context of this process shares the GPU with the MPS server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpk_dist.runtime.testing import compare_logits  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "runtime" / "ipc_job.py"
MAX_SEQ = 320
STALL_LIMIT_S = 120  # a stalled or dead rank must end the whole job well within this


def launch(n: int, mode: str, out: Path, *extra: str, limit: int = 400, env: dict | None = None):
    """Run the job on n ranks; returns (return code, {rank: json row}, seconds, output tail)."""
    cmd = [str(REPO / "launch" / "mpirun.sh"), "-n", str(n), "--exec", sys.executable, str(JOB), mode, str(out), *extra]
    full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                "MPK_GATHER_TIMEOUT_S": "30", **(env or {})}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=full_env)
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"rank"'):
            row = json.loads(line)
            rows[row["rank"]] = row
    secs, tail = time.perf_counter() - t0, (proc.stdout + proc.stderr)[-3000:]
    log = os.environ.get("MPK_IPC_LOG")  # scripts/gpu_check.sh keeps every job's outcome for debugging
    if log:
        with open(log, "a") as f:
            f.write(f"==== np {n} {mode} {' '.join(extra)}: rc {proc.returncode}, {secs:.1f} s\n{tail}\n")
    return proc.returncode, rows, secs, tail


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every mpirun job of this module, run once up front."""
    out = tmp_path_factory.mktemp("ipc")
    res = {"out": out}
    res["np2"] = launch(2, "check", out, "--repeats", "100", "--greedy-0p6b")
    res["stall"] = launch(2, "stall", out, limit=STALL_LIMIT_S + 60)
    res["die"] = launch(2, "die", out, limit=STALL_LIMIT_S + 60)
    res["np4"] = launch(4, "check", out, "--repeats", "10")
    return res


_REFS: dict = {}


def reference(name: str, prompt: list[int], force: list[int] | None, n: int, tp: int = 1, strict: bool = False):
    """The torch eager backend's result (teacher-forced logits or greedy tokens); built after the jobs."""
    from mpk_dist.backends import torch_ops as T
    from mpk_dist.backends.base import GenerateRequest
    from mpk_dist.backends.torch_backend import TorchBackend
    from mpk_dist.model_source import open_model

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    m = _REFS.setdefault(name, open_model(name, seed=0, device="cuda"))
    req = GenerateRequest([prompt], n, force_tokens=force, want_logits=force is not None)
    orig = T.linear
    if strict:  # the op table's fp32-accumulated linear (as in test_megakernel_tp_gpu.py)
        T.linear = lambda x, w, out_dtype=None: (lambda y: y if out_dtype == torch.float32 else y.to(
            w.dtype if out_dtype is None else out_dtype))(x.to(w.dtype).float() @ w.float().t())
    try:
        return TorchBackend(m.config, m.weights, tp=tp, device="cuda", max_seq_len=MAX_SEQ, mode="eager").generate(req)
    finally:
        T.linear = orig


@pytest.mark.parametrize("np_,name", [(2, "tiny"), (2, "tiny-llama"), (4, "tiny"), (4, "tiny-llama")])
def test_ipc_teacher_forced_logits(runs, np_, name, gpu_results):
    """mpirun -np N (MPS on one GPU): logits over 257 forced steps vs the tp-1 torch backend."""
    rc, rows, secs, tail = runs[f"np{np_}"]
    assert rc == 0 and sorted(rows) == list(range(np_)), tail
    saved = torch.load(runs["out"] / f"{name}_np{np_}.pt")
    want = reference(name, saved["prompt"], saved["force"], len(saved["force"]) + 1)
    err, agree = compare_logits(saved["logits"], want.logits.cpu())
    ok = err <= 0.03 and agree >= 0.99 and saved["logits"].shape == want.logits.shape
    gpu_results.append({"case": f"ipc np{np_} forced {name}", "steps": saved["logits"].shape[0],
                        "max_err/std": f"{err:.4f}", "argmax_agree": f"{agree:.4f}", "ok": ok})
    assert saved["logits"].shape == want.logits.shape
    assert err <= 0.03 and agree >= 0.99, (err, agree)


@pytest.mark.parametrize("np_", [2, 4])
def test_ipc_back_to_back_runs_are_bitwise_identical(runs, np_, gpu_results):
    """100 (np 2) / 10 (np 4) generations in a row: no hang, every rank's tokens and rank 0's
    merged logits equal the first run's bit for bit; rank 0 reports the exposed communication."""
    rc, rows, secs, tail = runs[f"np{np_}"]
    assert rc == 0, tail
    bad = {r: row["repeat_mismatches"] for r, row in rows.items()}
    share = rows[0].get("exposed_comm_share")
    gpu_results.append({"case": f"ipc np{np_} {rows[0]['repeats']} runs bitwise", "steps": 32,
                        "tokens_equal": not any(bad.values()), "ok": not any(bad.values())})
    gpu_results.append({"case": f"ipc np{np_} exposed comm share", "steps": "-", "ok": f"info: {share}"})
    assert not any(bad.values()), bad
    assert share is not None and 0.0 <= share <= 1.0


def test_ipc_greedy_qwen3_0p6b(runs, gpu_results):
    """mpirun -np 2: 64 greedy tokens equal the torch tp-2 backend's with fp32-accumulated linears."""
    rc, rows, secs, tail = runs["np2"]
    assert rc == 0, tail
    saved = torch.load(runs["out"] / "qwen3-0.6b_np2.pt")
    want = reference("qwen3-0.6b", saved["prompt"], None, 64, tp=2, strict=True)
    same = saved["tokens"] == want.tokens
    gpu_results.append({"case": "ipc np2 greedy qwen3-0.6b", "steps": 64, "tokens_equal": same, "ok": same})
    assert same, [(i, a, b) for i, (a, b) in enumerate(zip(saved["tokens"][0], want.tokens[0])) if a != b][:3]


def test_ipc_stalled_kernel_is_named_by_the_peer(runs, gpu_results):
    """Rank 1's kernel never signals a layer-0 task: rank 0's watchdog names peer rank 1 and the
    event; rank 1's names the task; the launcher exits non-zero within the bound."""
    rc, rows, secs, tail = runs["stall"]
    msg0, msg1 = rows.get(0, {}).get("error", ""), rows.get(1, {}).get("error", "")
    ok = rc != 0 and "waiting on peer rank 1" in msg0 and secs < STALL_LIMIT_S
    gpu_results.append({"case": "ipc np2 stalled kernel", "steps": "-", "ok": ok})
    print(msg0, msg1, sep="\n")
    assert rc != 0 and secs < STALL_LIMIT_S, tail
    assert msg0.startswith("DeviceTimeout") and "waiting on peer rank 1" in msg0, tail
    assert f"root cause: {rows[1]['victim']}" in msg1, tail


def test_ipc_rank_that_dies_before_launch(runs, gpu_results):
    """Rank 1 exits before the launch: mpirun ends the job (or rank 0's bounded pre-launch wait
    names rank 1); either way the launcher exits non-zero within the bound. (A rank that stalls on
    the host is the same bounded wait: tests/runtime/test_transport.py runs it under mpirun on the CPU.)"""
    rc, rows, secs, tail = runs["die"]
    ok = rc != 0 and secs < STALL_LIMIT_S
    gpu_results.append({"case": "ipc np2 rank 1 dies", "steps": "-", "ok": ok})
    assert rc != 0 and secs < STALL_LIMIT_S, tail
    msg0 = rows.get(0, {}).get("error", "")
    assert not msg0 or "ranks [1]" in msg0, msg0
