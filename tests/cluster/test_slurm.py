"""The sbatch templates on a real (local, one-node) Slurm cluster.

cluster/local/start.sh brings up munge + slurmctld + slurmd with 8 fake GPUs; the four templates
are submitted at once, each with 2 tasks running ``mpk-dist bench`` on the tiny preset (prompt 4, 2 new tokens, 1 iteration) (backend
MPK_TEST_SLURM_BACKEND, default interpreter) and every check reads what the jobs wrote:

- (a) tp_one_node: srun --mpi=pmix, --gpus-per-task=1: each rank sees one distinct GPU, device 0.
- (b) tp_mpirun: mpirun (launch/mpirun.sh) inside the allocation, --gres=gpu:2: ranks come from
  Open MPI (not SLURM_PROCID, which is 0 for both) and pick GPUs by local rank.
- (c) sweep: one JSON per (tp, batch) point and a merged summary.
- (d) dp_nodes: replicas gathered on rank 0 into one record with dp_replicas=2.

Finally the cluster is stopped and no process of it may remain. Needs root + apt when Slurm is not
installed (CI); the whole module takes 1-2 minutes on 2 cores with the interpreter.
"""

import csv
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
BACKEND = os.environ.get("MPK_TEST_SLURM_BACKEND", "interpreter")
JOB_TIMEOUT_S = 150
ITERS = 1  # per replica; the interpreter takes seconds per token on 2 cores


def _our_processes(cluster_dir: Path) -> list[int]:
    """Live (non-zombie) processes started for this cluster (stop.sh's marker variable)."""
    marker = f"MPK_LOCAL_SLURM={cluster_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if shutil.which("slurmctld") is None and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        pytest.fail("Slurm is not installed and this user cannot apt-get it: apt-get install slurmctld slurmd slurm-client munge libpmix-dev")
    cluster_dir = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "MPK_SLURM_GPUS": "8", "MPK_SLURM_CPUS": "8", "MPK_SLURM_INSTALL": "1", "MPK_SLURM_KEEP": "1"}
    start = subprocess.run([str(REPO / "cluster/local/start.sh"), str(cluster_dir)], env=env,
                           capture_output=True, text=True, timeout=600)
    assert start.returncode == 0, start.stderr[-3000:]
    assert start.stdout.strip() == f"export SLURM_CONF={cluster_dir}/slurm.conf"
    try:
        yield cluster_dir, {**os.environ, "SLURM_CONF": f"{cluster_dir}/slurm.conf"}
    finally:
        stop = subprocess.run([str(REPO / "cluster/local/stop.sh"), str(cluster_dir)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert _our_processes(cluster_dir) == [], "daemons or job processes survived stop.sh"


def _bench_env(base: dict, results: Path, **extra: str) -> dict:
    return {**base, "MPK_REPO": str(REPO), "MPK_MODEL": "tiny", "MPK_BACKEND": BACKEND, "MPK_TRANSPORT": "local",
            "MPK_PROMPT_LEN": "4", "MPK_OUTPUT_LEN": "2", "MPK_ITERS": str(ITERS), "MPK_RESULTS_DIR": str(results),
            "MPK_BENCH_EXTRA": "--warmup 0",
            "PYTHONPATH": f"{REPO}{os.pathsep}{base.get('PYTHONPATH', '')}", **extra}


def _submit(env: dict, out: Path, template: str, *opts: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", "-o", str(out), "--cpus-per-task=1", *opts, str(REPO / "cluster" / template)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job_state(env: dict, job: str) -> tuple[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True, timeout=30).stdout
    fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
    return fields.get("JobState", "?"), fields.get("ExitCode", "?")


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Submit the four templates together and wait (bounded) until all have finished."""
    cluster_dir, env = cluster
    work = tmp_path_factory.mktemp("jobs")
    ids = {
        "a": _submit(_bench_env(env, work / "ra", MPK_BENCH_EXTRA="--warmup 0 --dp"), work / "a.out",
                     "tp_one_node.sbatch", "--ntasks-per-node=2"),
        "b": _submit(_bench_env(env, work / "rb", MPK_BENCH_EXTRA="--warmup 0 --dp"), work / "b.out",
                     "tp_mpirun.sbatch", "--ntasks=2", "--gres=gpu:2"),
        "c": _submit(_bench_env(env, work / "rc", MPK_SWEEP_TP="1 2", MPK_SWEEP_BATCH="1 2"), work / "c.out",
                     "sweep.sbatch", "--ntasks=2"),
        "d": _submit(_bench_env(env, work / "rd", MPK_TP="2"), work / "d.out",
                     "dp_nodes.sbatch", "--nodes=1", "--ntasks-per-node=2"),
    }
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        states = {k: _job_state(env, j) for k, j in ids.items()}
        if all(s[0] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") for s in states.values()):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *ids.values()], env=env, timeout=30)
            pytest.fail(f"jobs did not finish within {JOB_TIMEOUT_S}s: {states}")
        time.sleep(1)
    return work, states


def _output(work: Path, key: str) -> str:
    return (work / f"{key}.out").read_text()


def _preflight(text: str) -> list[dict]:
    rows = [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in text.splitlines() if line.startswith("preflight ")]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.parametrize("key", ["a", "b", "c", "d"])
def test_job_completed(jobs, key):
    work, states = jobs
    assert states[key] == ("COMPLETED", "0:0"), _output(work, key)[-4000:]


def _gathered(path: Path) -> dict:
    records = json.loads(path.read_text())
    assert isinstance(records, list) and len(records) == 1
    rec = records[0]
    assert rec["model"] == "tiny" and rec["tp"] == 2 and rec["batch"] == 1
    assert rec["dp_replicas"] == 2 and len(rec["replicas"]) == 2
    assert all(r["ms_per_token_p50"] > 0 for r in rec["replicas"])
    # Pooled: 2 replicas x ITERS iterations, each with the same number of decode steps.
    assert rec["iters"] == 2 * ITERS and len(rec["prefill_ms"]) == 2 * ITERS
    assert len(rec["decode_step_ms"]) % (2 * ITERS) == 0
    assert rec["backend"] == BACKEND
    assert rec["avg_latency"] > 0 and set(rec["percentiles"]) >= {"50", "99"}
    return rec


def test_a_srun_pmix_gpus_per_task(jobs):
    work, _ = jobs
    rows = _preflight(_output(work, "a"))
    assert [r["rank"] for r in rows] == ["0/2", "1/2"]
    assert {r["source"] for r in rows} == {"pmix+slurm"}
    assert all(r["device"] == "0" and "," not in r["visible"] for r in rows)
    assert rows[0]["visible"] != rows[1]["visible"]  # each task got its own GPU
    _gathered(work / "ra" / "tiny_tp2_b1.json")


def test_b_mpirun_in_allocation_gres(jobs):
    work, _ = jobs
    rows = _preflight(_output(work, "b"))
    assert [r["rank"] for r in rows] == ["0/2", "1/2"]
    assert {r["source"] for r in rows} == {"openmpi"}  # SLURM_PROCID would say 0 for both
    assert rows[0]["visible"] == rows[1]["visible"] and len(rows[0]["visible"].split(",")) == 2
    assert sorted(r["device"] for r in rows) == ["0", "1"]
    _gathered(work / "rb" / "tiny_tp2_b1_mpirun.json")


def test_c_sweep_one_file_per_point(jobs):
    work, _ = jobs
    points = {(tp, b) for tp in (1, 2) for b in (1, 2)}
    for tp, b in points:
        (rec,) = json.loads((work / "rc" / f"tiny_tp{tp}_b{b}.json").read_text())
        assert (rec["tp"], rec["batch"], rec["backend"]) == (tp, b, BACKEND) and rec["ms_per_token_p50"] > 0
    rows = list(csv.DictReader((work / "rc" / "summary.csv").open()))
    assert {(int(r["tp"]), int(r["batch"])) for r in rows} == points
    assert "# OK: 4 points" in _output(work, "c")


def test_d_replicas_gathered_on_rank0(jobs):
    work, _ = jobs
    rows = _preflight(_output(work, "d"))
    assert [r["rank"] for r in rows] == ["0/2", "1/2"]
    rec = _gathered(work / "rd" / "tiny_tp2_b1_dp2.json")
    assert [r["replica"] for r in rec["replicas"]] == [0, 1]
    assert {r["hostname"] for r in rec["replicas"]} == {rows[0]["node"]}
