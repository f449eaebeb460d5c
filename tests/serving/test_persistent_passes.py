"""Persistent passes on the compiled task graph (interpreter, race-checked): one launch runs many
passes, the host posting each pass into the running launch (docs/SERVING.md "Persistent passes").
Every request equals it alone and equals the launch-per-pass server bit for bit, at tp 1 and 2; a
launch ends after P passes and the next pass starts a new one; the host-write check fires on a
program where a reader of the pass inputs is not an ancestor of the final task."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk_dist.backends.base import GenerateRequest
from mpk_dist.backends.torch_backend import TorchBackend
from mpk_dist.errors import InputError
from mpk_dist.models.llama import PagedSpec
from mpk_dist.models.presets import get_preset
from mpk_dist.serving.server import Server, VirtualClock
from mpk_dist.weights import SyntheticSource

WORKLOAD = [([5, 17, 99, 3, 200, 8, 42], 5, 0.0), ([1, 2, 3], 6, 0.0), ([9] * 14, 3, 0.015), ([300, 301], 4, 0.03)]
FORCE = [None, [7, 7, 100, 3, 5, 9], None, [450, 2, 2, 2]]


def _serve(cfg, src, tp: int, opts: dict):
    srv = Server((cfg, src), backend="interpreter", tp=tp, max_batch=3, page_size=4, max_seq_len=24,
                 max_tokens_per_step=12, clock=VirtualClock(0.01), backend_opts=opts)
    for (p, n, t), f in zip(WORKLOAD, FORCE):
        srv.submit(p, n, t, force_tokens=f, want_logits=True)
    return srv.run(check_pages=True), srv


@pytest.mark.parametrize("tp, schedule, passes", [(1, "jit", 64), (2, "aot", 5)])
def test_persistent_passes_equal_launch_per_pass_and_each_request_alone(tp, schedule, passes):
    cfg = dataclasses.replace(get_preset("tiny"), dtype="float32")
    src = SyntheticSource(cfg, seed=5)
    outs, srv = _serve(cfg, src, tp, {"schedule": schedule, "seed": tp, "persistent_passes": passes})
    base, base_srv = _serve(cfg, src, tp, {"schedule": schedule, "seed": tp})
    n = len(srv.passes)
    assert n == len(base_srv.passes) and n > passes // 8
    # P passes per launch: one launch holds them all (64), or a new launch every 5 passes
    assert srv.backend.launches == -(-n // passes) and base_srv.backend.launches == n
    ref = TorchBackend(cfg, src, tp=tp, max_seq_len=64)
    for (p, k, _), f, o, b in zip(WORKLOAD, FORCE, outs, base):
        assert o.tokens == b.tokens and torch.equal(o.logits, b.logits)  # same program, same sums
        alone = ref.generate(GenerateRequest([p], max_new_tokens=k, want_logits=True, force_tokens=f))
        assert o.tokens == alone.tokens[0]
        want = alone.logits[:, 0]
        assert float(((o.logits - want).abs().amax(-1) / want.abs().amax(-1)).max()) <= 1e-5
    assert srv.pool.num_free == srv.pool.num_pages


def test_host_write_check_names_a_reader_left_behind():
    """PersistentLaunch.post refuses to overwrite pass inputs that a pending task of an earlier step
    still reads (on the GPU the host would race it): simulated by posting before the final task ran."""
    from mpk_dist.models.llama import build_paged_graph
    from mpk_dist.taskgraph.interpreter import Interpreter, PersistentLaunch
    from mpk_dist.taskgraph.paged_compiler import PERSISTENT_INPUTS, compile_paged_programs, page_state
    from mpk_dist.weights import load_rank_weights

    cfg = dataclasses.replace(get_preset("tiny"), dtype="float32")
    spec = PagedSpec(max_tokens=4, max_seqs=2, num_pages=8, page_size=4, max_pages_per_seq=4)
    cgs = compile_paged_programs(cfg, spec, 1, sms=4, max_steps=3)
    w = [load_rank_weights(build_paged_graph(cfg, spec, tp=1, rank=0), SyntheticSource(cfg, seed=1))]
    it = Interpreter(cgs, w, seed=0)
    it.reset_state()
    for name, a in page_state(cgs[0]).items():
        it.buffer(0, name).copy_(torch.from_numpy(a))
    launch = PersistentLaunch(it, 3, PERSISTENT_INPUTS)

    def write(r: int) -> None:
        it.buffer(r, "forced_tokens")[launch.posted].fill_(1)
        it.buffer(r, "seq_slots").copy_(torch.tensor([0, 0, 1, -1], dtype=torch.int32))
        it.buffer(r, "release_slots").zero_()
        it.buffer(r, "logit_rows").copy_(torch.tensor([1, 2], dtype=torch.int32))
        it.buffer(r, "start_pos").copy_(torch.tensor([0, 1, 0, 0], dtype=torch.int32) - launch.posted)

    launch.post(0, write)
    with pytest.raises(AssertionError, match="has not read them yet"):
        launch.post(1, write)  # step 0 has not run at all: its readers of the inputs are pending
    launch.wait_final(0)
    launch.post(1, write)  # after the final task every reader of step 0 has run
    with pytest.raises(InputError, match="expected step 2 next"):
        launch.post(3, write)


def test_static_check_names_a_reader_outside_the_final_tasks_ancestors():
    """check_persistent_inputs (run by compile_paged_programs for max_steps > 1) passes on the real
    program and names the task when a reader of a pass input loses its path to argmax_select."""
    import numpy as np

    from mpk_dist.taskgraph.abi import TASK_COLS
    from mpk_dist.taskgraph.paged_compiler import check_persistent_inputs, compile_paged_programs
    from mpk_dist.taskgraph.tasks import BY_NAME

    cfg = dataclasses.replace(get_preset("tiny"), dtype="float32")
    spec = PagedSpec(max_tokens=4, max_seqs=2, num_pages=8, page_size=4, max_pages_per_seq=4)
    cg = compile_paged_programs(cfg, spec, 1, sms=4, max_steps=3)[0]
    check_persistent_inputs(cg)
    # cut the signals of a gather_rows task (a reader of logit_rows): no longer an ancestor of the head
    t = int(np.nonzero(cg.arrays["tasks"][:, TASK_COLS["OPCODE"]] == BY_NAME["gather_rows"].opcode)[0][0])
    row = cg.arrays["tasks"][t]
    row[TASK_COLS["SIGNAL_END"]] = row[TASK_COLS["SIGNAL_BEGIN"]]
    with pytest.raises(AssertionError, match="gather_rows.*reads \\['logit_rows'\\]"):
        check_persistent_inputs(cg)
