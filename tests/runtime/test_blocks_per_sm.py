"""Two worker blocks per SM (MPK_BLOCKS_PER_SM, KernelShape.blocks_per_sm): the kernel source, the knob, the
worker count and the co-residency check, on the CPU."""

import pytest

from mpk_dist.errors import BackendUnavailable, InputError
from mpk_dist.runtime.codegen import KernelShape, render_source
from mpk_dist.runtime.megakernel_backend import tuning_from_env


def test_shape_renders_the_launch_bound_only_when_asked():
    one, two = KernelShape(batch=1), KernelShape(batch=1, blocks_per_sm=2)
    assert "MPK_MIN_BLOCKS_PER_SM" not in render_source(one)  # the default source (and its cache key) as before
    assert "#define MPK_MIN_BLOCKS_PER_SM 2" in render_source(two)
    assert two.name().endswith("_bs2") and not one.name().endswith("_bs1")
    with pytest.raises(ValueError, match="blocks_per_sm: expected one of"):
        render_source(KernelShape(batch=1, blocks_per_sm=3))


def test_knob_is_parsed_and_refused_with_the_allowed_values():
    assert "blocks_per_sm" not in tuning_from_env(None, environ={})
    assert "blocks_per_sm" not in tuning_from_env(None, environ={"MPK_BLOCKS_PER_SM": "1"})
    assert tuning_from_env(None, environ={"MPK_BLOCKS_PER_SM": "2"})["blocks_per_sm"] == 2
    with pytest.raises(InputError, match=r"MPK_BLOCKS_PER_SM: expected one of 1, 2, got '4'"):
        tuning_from_env(None, environ={"MPK_BLOCKS_PER_SM": "4"})


def test_backend_runs_two_workers_per_sm_when_two_blocks_fit(fake_gpu, monkeypatch):
    from mpk_dist.model_source import open_model
    from tests.runtime.conftest import FakeKernel

    m = open_model("tiny")
    monkeypatch.setenv("MPK_BLOCKS_PER_SM", "2")
    b = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16)
    assert b.workers == 16  # fake_gpu's 8 SMs, two workers each
    with pytest.raises(BackendUnavailable, match=r"16 blocks <= 1 blocks/SM x 8 SMs"):
        b.session(1)  # the fake kernel reports one resident block per SM: refused, not launched
    monkeypatch.setattr(FakeKernel, "blocks_per_sm", 2)
    s = fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16).session(1)
    assert s.workers == 16 and int(s.cg.meta["workers"]) == 16
    monkeypatch.delenv("MPK_BLOCKS_PER_SM")
    assert fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16).workers == 8


def test_refused_beside_other_ranks_or_an_sm_cap(fake_gpu, monkeypatch):
    """The two blocks of an SM pair up by %smid (csrc/runtime/worker_index.cuh), which needs every SM to itself."""
    from mpk_dist.model_source import open_model

    m = open_model("tiny")
    monkeypatch.setenv("MPK_BLOCKS_PER_SM", "2")
    with pytest.raises(InputError, match=r"MPK_BLOCKS_PER_SM=2: expected one rank per GPU and every SM"):
        fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, sms=4)
    with pytest.raises(InputError, match=r"got 2 rank\(s\) per GPU"):
        fake_gpu.MegakernelBackend(m.config, m.weights, device="cpu", max_seq_len=16, tp=2)


def test_a_block_left_unpaired_is_named():
    """Watchdog code 10 (kErrPairWait): which SM waited, how many of its blocks counted in, and what to do."""
    from mpk_dist.runtime.diagnosis import error_message
    from mpk_dist.runtime.params import ErrorRecord

    class Sess:
        cg = None

        @staticmethod
        def error_record():
            return ErrorRecord(code=10, valid=1, task_id=-1, event_id=-1, step=0, sm_id=17, worker=40, rank=0, seen=1,
                               expected=2, elapsed_ns=5 * 10**9, peer=-1)

    msg = error_message(Sess())
    assert "worker pairing" in msg and "SM 17" in msg and "(1 block(s) counted in, expected 2)" in msg, msg
    assert "MPK_BLOCKS_PER_SM=1" in msg, msg


def test_two_blocks_take_256_threads_and_refuse_more():
    """qwen3-1.7b's program takes 512 threads a block by default; two blocks an SM take 256 (128 registers a thread),
    and an explicit 512 beside them is refused with the values that work."""
    from mpk_dist.models.presets import get_preset
    from mpk_dist.runtime.session import PAIRED_WORKER_THREADS, kernel_shape
    from mpk_dist.taskgraph.compiler import compile_rank_programs

    cg = compile_rank_programs(get_preset("qwen3-1.7b"), tp=1, batch=1, ranks=[0], max_seq_len=544)[0]
    assert kernel_shape(cg, None, "aot").worker_threads == 512
    assert kernel_shape(cg, None, "aot", blocks_per_sm=2).worker_threads == PAIRED_WORKER_THREADS == 256
    with pytest.raises(InputError, match=r"MPK_BLOCKS_PER_SM=2 with MPK_WORKER_THREADS=512: expected at most 256"):
        kernel_shape(cg, 512, "aot", blocks_per_sm=2)


def test_prebuild_builds_the_kernel_a_two_blocks_run_builds(monkeypatch):
    """The prebuild compiles the program for 2 x 132 workers under MPK_BLOCKS_PER_SM=2, as the run does: at
    qwen3-1.7b the tiles of a 264-worker program choose unroll 4 and compact code, a 132-worker one unroll 8."""
    from mpk_dist.runtime import kernel, prebuild

    shapes = []
    monkeypatch.setattr(kernel, "build_kernel", lambda shape, **kw: shapes.append(shape) or ("src", _Built()))
    monkeypatch.setenv("MPK_BLOCKS_PER_SM", "2")
    prebuild._build_one(prebuild.BuildCase("qwen3-1.7b", 1, 1, "aot", max_seq_len=544))
    assert [s.name() for s in shapes] == ["mk_b1_t256_aot_u4_p64_cc_bs2"]


class _Built:
    class path:
        name = "mk.cubin"

    cached = True
