"""One process per TP rank (mpirun + torch.distributed/gloo) gives what the single-process TP run gives."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.mpi


def test_mpirun_tp2_matches_single_process(tmp_path, hf_models):
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not on PATH: install the test extras (pip install -e '.[test]')"
    ckpt, _ = hf_models["llama31-untied"]
    args = ["run", "--backend", "torch", "--model", str(ckpt), "--tp", "2", "--prompt-ids", "5,17,99,3",
            "--max-new-tokens", "6", "--json"]
    single = subprocess.run([sys.executable, "-m", "mpk_dist", *args, "--dump-logits", str(tmp_path / "a.npy")],
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    multi = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
                            "mpk_dist", *args, "--dump-logits", str(tmp_path / "b.npy")],
                           capture_output=True, text=True, timeout=180)
    assert multi.returncode == 0, multi.stderr[-2000:]
    outs = [json.loads(line) for line in multi.stdout.splitlines() if line.startswith("{")]
    assert len(outs) == 1, "only rank 0 prints the result"
    assert outs[0]["tokens"] == json.loads(single.stdout)["tokens"]
    np.testing.assert_allclose(np.load(tmp_path / "b.npy"), np.load(tmp_path / "a.npy"), rtol=0, atol=1e-5)
