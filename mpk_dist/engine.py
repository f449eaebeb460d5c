"""Generation front end shared by ``mpk-dist run`` and ``mpk-dist bench``.

Turns user input (text or ids, flags) into a validated ``GenerateRequest``, builds the backend,
and summarises latencies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpk_dist.backends.base import GenerateRequest, SamplingParams
from mpk_dist.backends.registry import create_backend, default_device, resolve_backend
from mpk_dist.errors import InputError
from mpk_dist.model_source import ModelSource, open_model

DEFAULT_PROMPT = "The quick brown fox"


def parse_id_list(text: str, flag: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; a clear error for anything else."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InputError(f"{flag}: expected comma-separated integers like 1,2,3, got {text!r}") from None
    if not ids:
        raise InputError(f"{flag}: expected at least one id, got {text!r}")
    return ids


def prompt_ids(model: ModelSource, prompt: str | None, ids: str | None) -> list[int]:
    """The prompt as token ids, validated against the vocabulary."""
    if prompt is not None and ids is not None:
        raise InputError("prompt: give --prompt or --prompt-ids, not both")
    out = parse_id_list(ids, "--prompt-ids") if ids is not None else model.tokenizer.encode(prompt or DEFAULT_PROMPT)
    if not out:
        raise InputError("prompt: expected at least one token, got an empty prompt")
    check_ids(out, model.config.vocab_size, "--prompt-ids" if ids is not None else "prompt")
    return out


def check_ids(ids: list[int], vocab: int, flag: str) -> None:
    """Every id must index the vocabulary."""
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InputError(f"{flag}: token id {bad[0]} out of range; expected 0 <= id < vocab_size={vocab}")


SEQ_LEN_ALIGN = 64
"""A KV-cache length sized from the context is rounded up to a multiple of this, so nearby prompt lengths share one
compiled program (the program's tables depend on max_seq_len; the kernel binary does not)."""


def context_max_seq_len(prompt_len: int, max_new_tokens: int, max_positions: int) -> int:
    """The KV-cache length a run sizes when --max-seq-len is not given: the prompt plus the new tokens, rounded up to
    SEQ_LEN_ALIGN and capped at the model's ``max_positions``. Why not a fixed length: split-KV attention cuts its
    ranges from max_seq_len, so a cache far longer than the context leaves most ranges empty and the rest long
    (qwen3-0.6b at context ~512: 1.092 ms a token with a 576-position cache, 1.239 ms with 2048; docs/PERF.md v0.24).
    An error names the limit when the sequence does not fit the model."""
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: expected >= 1, got {max_new_tokens}")
    need = prompt_len + max_new_tokens
    if need > max_positions:
        raise InputError(
            f"sequence length: prompt ({prompt_len} tokens) + --max-new-tokens ({max_new_tokens}) = {need}, expected "
            f"at most the model's max_position_embeddings={max_positions}; shorten the prompt or the generation")
    return min(max_positions, -(-need // SEQ_LEN_ALIGN) * SEQ_LEN_ALIGN)


def check_length(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> None:
    """The prompt plus the generated tokens must fit the KV cache."""
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: expected >= 1, got {max_new_tokens}")
    if prompt_len + max_new_tokens > max_seq_len:
        raise InputError(
            f"sequence length: prompt ({prompt_len} tokens) + --max-new-tokens ({max_new_tokens}) = "
            f"{prompt_len + max_new_tokens}, expected at most --max-seq-len={max_seq_len}; "
            "shorten the prompt or raise --max-seq-len")


@dataclass
class RunSpec:
    """Everything one generation needs."""

    model: str
    backend: str = "auto"
    tp: int = 1
    batch: int = 1
    max_new_tokens: int = 32
    max_seq_len: int = 1024
    device: str | None = None
    seed: int = 0
    backend_opts: dict | None = None


def build_backend(spec: RunSpec, model: ModelSource | None = None):
    """Open the model (if not given) and create the backend for it."""
    name = resolve_backend(spec.backend)
    if model is None:
        model = open_model(spec.model, seed=spec.seed, device=spec.device or default_device(name))
    if spec.max_seq_len > model.config.max_position_embeddings:
        raise InputError(f"--max-seq-len: expected at most max_position_embeddings="
                         f"{model.config.max_position_embeddings}, got {spec.max_seq_len}")
    backend = create_backend(name, model.config, model.weights, tp=spec.tp, device=spec.device,
                             max_seq_len=spec.max_seq_len, **(spec.backend_opts or {}))
    return model, backend


def make_request(prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams, stop_ids=(),
                 force_tokens: list[int] | None = None, want_logits: bool = False) -> GenerateRequest:
    """A request; forced tokens must cover the steps that feed a next input."""
    if force_tokens is not None and len(force_tokens) < max_new_tokens - 1:
        raise InputError(f"--force-tokens: expected at least --max-new-tokens - 1 = {max_new_tokens - 1} ids, "
                         f"got {len(force_tokens)}")
    return GenerateRequest(prompts, max_new_tokens, sampling, tuple(stop_ids), force_tokens, want_logits)


def latency_summary(per_token_ms: list[float]) -> dict:
    """p50/p90/p99/mean of per-token latencies (ms) and tokens/s of one sequence."""
    if not per_token_ms:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "mean": float("nan"), "tokens_per_s": float("nan")}
    a = np.asarray(per_token_ms, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()), "tokens_per_s": float(1e3 / a.mean())}
