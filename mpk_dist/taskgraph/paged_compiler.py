"""Compile the paged-KV graphs of all TP ranks (one ragged pass per launch) into task-graph programs.

Same pipeline as ``compiler.compile_rank_programs`` (lower, events on rank 0, serialize, validate)
over ``models.llama.build_paged_graph``. By default the head runs over the MB sequences: a
``gather_rows`` task picks each emitting sequence's last token row (``logit_rows``) before the final
norm, so ``logits`` is [MB, V/tp]; ``gather_last=False`` keeps the head over all N token rows
(``logits`` [N, V/tp], the rows picked on the host). One step per launch by default (``max_steps`` 1): the host
lays out each pass (tokens, positions, slots, page table) between launches. ``max_steps`` P > 1 is the
persistent form: one launch runs up to P passes, pass s as step s (forced_tokens row s, start_pos = positions - s),
the host posting each pass while the kernel runs (docs/SERVING.md "Persistent passes").
"""

from __future__ import annotations

from mpk_dist.config import ModelConfig
from mpk_dist.errors import InputError
from mpk_dist.models.llama import PagedSpec, build_paged_graph
from mpk_dist.taskgraph.compiler import _same_structure
from mpk_dist.taskgraph.deps import build_events, reduce_events
from mpk_dist.taskgraph.lowering_comm import lower_graph
from mpk_dist.taskgraph.serialize import CompiledGraph, serialize
from mpk_dist.taskgraph.validate import validate


def compile_paged_programs(cfg: ModelConfig, spec: PagedSpec, tp: int, sms: int = 16,
                           check: bool = True, gather_last: bool = True, max_steps: int = 1) -> list[CompiledGraph]:
    """The validated paged program of every rank (rank order); ``gather_last``: head over MB rows;
    ``max_steps``: passes one launch can run (1: a launch per pass)."""
    if max_steps < 1:
        raise InputError(f"paged program: expected max_steps >= 1 (passes per launch), got {max_steps}")
    progs = [lower_graph(build_paged_graph(cfg, spec, tp=tp, rank=r, gather_last=gather_last), sms,
                         max_steps=max_steps)
             for r in range(tp)]
    eg = reduce_events(build_events(progs[0]))
    info = {"model": cfg.architecture or cfg.family, "family": cfg.family,
            "max_seq_len": spec.page_size * spec.max_pages_per_seq, "sms": sms, "num_layers": cfg.num_layers,
            "paged": {"max_tokens": spec.max_tokens, "max_seqs": spec.max_seqs, "num_pages": spec.num_pages,
                      "page_size": spec.page_size, "max_pages_per_seq": spec.max_pages_per_seq,
                      "gather_last": gather_last}}
    out = []
    for r, prog in enumerate(progs):
        if not _same_structure(progs[0], prog):
            raise AssertionError(f"rank {r}: paged task graph structure differs from rank 0")
        cg = serialize(prog, eg, info, sms)
        if check:
            validate(cg, structure=(r == 0))
        out.append(cg)
    return out
