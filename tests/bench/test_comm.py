"""CPU tests of ``mpk-dist bench-comm`` (mpk_dist/bench/comm.py): the kernel builds for sm_90a and its
signatures match what the driver passes, the flags and launch errors, the exact-arithmetic inputs,
result checking, and the table / JSON from fake per-rank figures."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpk_dist.bench import comm
from mpk_dist.bench.comm_report import build_record, combine_ranks, compare, format_table, nccl_tolerance
from mpk_dist.cli import main
from mpk_dist.errors import InputError

REPO = Path(__file__).resolve().parents[2]
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH (CI installs CUDA 13.0)")


@needs_nvcc
def test_kernel_compiles_for_sm90a_and_needs_the_layout(tmp_path, monkeypatch):
    """comm_bench.cu builds with the LAYOUT defines; without them it stops with the #error."""
    from mpk_dist.runtime.build import BuildError, compile_source

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    res = comm.build_kernel(compiler="nvcc", use_cache=False)
    assert res.cubin[:4] == b"\x7fELF"
    assert {"sync.cuh", "allreduce_push.cuh", "allreduce_reduce.cuh"} <= {p.name for p in res.headers}
    for name in (b"comm_pingpong", b"comm_allreduce"):
        assert name in res.cubin, f"{name!r} missing: extern \"C\" entry points are what the driver looks up"
    with pytest.raises(BuildError, match="build_kernel"):
        compile_source(comm.KERNEL_SOURCE.read_text(), "comm_bench_nodefs", compiler="nvcc", use_cache=False)


def _signature(kernel: str) -> list[tuple[str, int]]:
    """(name, bytes) of each parameter of ``kernel`` as written in comm_bench.cu."""
    text = comm.KERNEL_SOURCE.read_text()
    m = re.search(rf'extern "C" __global__ void {kernel}\(([^)]*)\)', text)
    assert m, f"{kernel} not found in {comm.KERNEL_SOURCE}"
    out = []
    for param in " ".join(m.group(1).split()).split(","):
        decl = param.strip()
        name = re.findall(r"\w+", decl)[-1]
        size = 8 if "*" in decl or "uint64_t" in decl else 4 if re.match(r"(const )?(int|uint32_t)\b", decl) else -1
        out.append((name, size))
    return out


@pytest.mark.parametrize("kernel", sorted(comm.KERNEL_ARGS))
def test_driver_arguments_match_kernel_signature(kernel):
    assert _signature(kernel) == list(comm.KERNEL_ARGS[kernel])


def test_pack_args_orders_and_refuses_missing():
    vals = dict(peers=1, rank=1, iters=5, timed_from=2, timeout_ns=3 << 33, status=7)
    args = comm.pack_args("comm_pingpong", **vals)
    assert [a.value for a in args] == [1, 1, 5, 2, 3 << 33, 7]
    assert [type(a).__name__ for a in args][1] in ("c_int", "c_int32")
    with pytest.raises(ValueError, match="timed_from"):
        comm.pack_args("comm_pingpong", **{k: v for k, v in vals.items() if k != "timed_from"})


def test_layout_regions_do_not_overlap():
    L = comm.LAYOUT
    assert L["CB_PP_FLAG_OFF"] + 4 <= L["CB_AR_FLAG_OFF"]
    assert L["CB_AR_FLAG_OFF"] + 4 * L["CB_MAX_BLOCKS"] * L["CB_MAX_WORLD"] <= L["CB_RECV_OFF"]
    assert L["CB_RECV_OFF"] % 16 == 0, "16-byte stores into the slots"
    assert L["CB_ST_TIMES"] % 2 == 0 and L["CB_ST_TIMES"] + 4 <= L["CB_ST_AR_EPOCH"], "two uint64 after the error record"
    assert L["CB_ST_AR_EPOCH"] + L["CB_MAX_BLOCKS"] <= L["CB_ST_PP_EPOCH"] < comm.STATUS_WORDS


@pytest.mark.parametrize("n", [128, 512, 8192, 8192 * 4, 1536])
def test_ar_blocks_split_into_whole_vectors(n):
    b = comm.ar_blocks(n)
    assert 1 <= b <= comm.LAYOUT["CB_MAX_BLOCKS"] and n % (8 * b) == 0
    if n == 8192:
        assert b == 16


def test_cli_refuses_a_single_process(capsys):
    assert main(["bench-comm"]) == 2
    err = capsys.readouterr().err
    assert "expected >= 2 MPI ranks" in err and "launch/mpirun.sh -n 2 bench-comm" in err


@pytest.mark.parametrize("flags, what", [(["--size-bytes", "1000"], "--size-bytes"), (["--iters", "0"], "--iters"),
                                         (["--timeout", "0"], "--timeout"), (["--warmup", "-1"], "--warmup")])
def test_cli_refuses_bad_flags(capsys, flags, what):
    assert main(["bench-comm", *flags]) == 2
    assert f"{what}: expected" in capsys.readouterr().err


def test_launch_errors_name_the_problem():
    with pytest.raises(InputError, match="at most 8 ranks"):
        comm.check_world(9, "openmpi")
    with pytest.raises(comm.BackendUnavailable, match="CUDA GPU on rank 3"):
        comm.check_gpu(False, 3)
    with pytest.raises(InputError, match="ranks 0 and 2 on GPU GPU-a"):
        comm.check_distinct_gpus(["GPU-a", "GPU-b", "GPU-a"])
    comm.check_distinct_gpus(["GPU-a", "GPU-b"])


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not on PATH")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_under_mpirun_without_gpu_every_rank_says_so():
    env = {**os.environ, "MPK_DIST": f"{sys.executable} -m mpk_dist",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([str(REPO / "launch" / "mpirun.sh"), "-n", "2", "--gpus", "0", "bench-comm"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "expected a CUDA GPU on rank" in proc.stderr


def test_inputs_differ_per_rank_and_sums_are_exact_in_bf16():
    n, world = 8192, 8
    xs = [comm.rank_input(r, n) for r in range(world)]
    assert all(not torch.equal(xs[0], x) for x in xs[1:])
    acc = torch.zeros(n, dtype=torch.bfloat16)
    for k, x in enumerate(xs):  # every partial sum rounded to bf16, like a bf16 ring reduction
        acc = acc + x
        assert torch.equal(acc, comm.expected_sum(k + 1, n)), f"partial sum of {k + 1} ranks is not exact"


def test_compare_reports_a_wrong_sum():
    want = comm.expected_sum(2, 8192)
    ok, detail = compare("ours eager", want.clone(), want)
    assert ok
    got = want.clone()
    got[1234] += 0.5
    ok, detail = compare("ours eager", got, want)
    assert not ok and "1 wrong element" in detail and "at 1234" in detail
    got = want.clone()
    got[7] = float("nan")
    assert not compare("ours graph", got, want)[0]
    near = (want.float() * (1 + 2 ** -9)).to(torch.bfloat16)
    assert compare("nccl eager", near, want, nccl_tolerance(2))[0]


def _fake_rank(rank: int, slow: float = 1.0, bad: str | None = None) -> dict:
    checks = {c: (True, f"{c}: OK") for c in ("pingpong", "ours in-kernel", "ours eager", "ours graph", "ours fresh slots",
                                              "nccl eager", "ours vs nccl")}
    if bad:
        checks[bad] = (False, f"{bad}: expected the sum within 0, got 3 wrong element(s)")
    return {"rank": rank, "pingpong_us": 0.9 if rank == 0 else None, "ours_inkernel_us": 2.0 * slow,
            "ours_eager_us": 6.0 * slow, "ours_graph_us": 3.0 * slow, "nccl_eager_us": 12.0, "nccl_graph_us": 8.0,
            "checks": checks}


def test_table_and_json_from_fake_rows(tmp_path):
    per_rank = [_fake_rank(0), _fake_rank(1, slow=1.5)]
    rows, failures = combine_ranks(per_rank, 16384)
    assert not failures
    eager = next(r for r in rows if r["test"] == "allreduce eager")
    assert eager["ours_us"] == 9.0 and eager["ours_over_nccl"] == pytest.approx(0.75), "max over ranks"
    assert rows[-1]["ours_us"] == 0.9 and rows[-1]["nccl_us"] is None
    text = format_table(rows, failures, ["preamble line"])
    lines = text.splitlines()
    assert lines[0] == "# preamble line" and "ours (us)" in lines[1] and "NCCL (us)" in lines[1]
    assert lines[-1] == "# OK" and "# pingpong one-way latency: 0.900 us" in text
    opts = comm.CommOptions(iters=10)
    env = {"gpu": "fake", "gpu_count": 2, "date": "2026-01-01T00:00:00+00:00", "git_commit": "abc", "versions": {}}
    rec = json.loads(json.dumps(build_record(rows, failures, per_rank, opts, env)))
    assert rec["ok"] is True and rec["pingpong_one_way_us"] == 0.9 and rec["iters"] == 10
    assert {"gpu", "gpu_count", "date", "git_commit"} <= rec.keys() and len(rec["per_rank"]) == 2


def test_a_failed_check_fails_its_row_and_the_footer():
    rows, failures = combine_ranks([_fake_rank(0), _fake_rank(1, bad="ours graph")], 16384)
    assert failures == ["rank 1: ours graph: expected the sum within 0, got 3 wrong element(s)"]
    by_test = {r["test"]: r["ok"] for r in rows}
    assert by_test["allreduce graph"] is False and by_test["allreduce eager"] is True
    text = format_table(rows, failures, [])
    assert text.splitlines()[-1] == "# FAILED" and "# FAILED rank 1: ours graph" in text


def test_a_missing_check_is_a_failure():
    broken = _fake_rank(1)
    del broken["checks"]["ours in-kernel"]
    rows, _ = combine_ranks([_fake_rank(0), broken], 16384)
    assert {r["test"]: r["ok"] for r in rows}["allreduce in-kernel vs NCCL graph"] is False


def test_timeout_message_names_rank_flag_and_writer():
    msg = comm.timeout_message([2, 3, 0, 17, 16, 5, 1], 30.0)
    assert "rank 1 waited on its all-reduce flag of block 3 written by rank 0" in msg
    assert "expected >= 17, got 16 after 30 s" in msg and "--timeout" in msg
    assert "ping-pong flag written by rank 1" in comm.timeout_message([1, 0, 1, 4, 3, 3, 0], 5)
    status = torch.tensor([2, 3, 0, 17, 16, 5, 1, 0], dtype=torch.int32)
    with pytest.raises(comm.DeviceTimeout, match="block 3"):
        comm.raise_on_error(status, 30.0)
    comm.raise_on_error(torch.zeros(8, dtype=torch.int32), 30.0)
