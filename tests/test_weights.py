"""Checkpoint loading: index files, tied embeddings, slice-only reads, and every bad-input error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpk_dist.errors import CheckpointError
from mpk_dist.model_source import open_model
from mpk_dist.models import build_graph
from mpk_dist.weights import SafetensorsSource, load_rank_weights


def _copy_ckpt(src, dst, mutate):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_sharded_index_checkpoint_loads_like_a_single_file(tmp_path, hf_models, hf_checkpoint_factory):
    hf_checkpoint_factory("llama31-untied", tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    single_dir, _ = hf_models["llama31-untied"]
    a, b = open_model(str(single_dir)), open_model(str(tmp_path / "sharded"))
    g = build_graph(a.config, tp=2, rank=1)
    wa, wb = load_rank_weights(g, a.weights), load_rank_weights(g, b.weights)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_tied_lm_head_reads_the_embedding(hf_models):
    ckpt, _ = hf_models["qwen3-tied"]
    src = open_model(str(ckpt))
    assert "lm_head.weight" not in src.weights.names()
    w = load_rank_weights(build_graph(src.config, tp=2, rank=1), src.weights)
    assert torch.equal(w["lm_head"], w["embed"])


class _Recorder:
    """Wraps a source and records every slice requested."""

    def __init__(self, inner):
        self.inner, self.parts = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, part):
        self.parts.append(part)
        return self.inner.read(part)


def test_rank_reads_only_its_slices(hf_models):
    ckpt, _ = hf_models["llama31-untied"]
    src = open_model(str(ckpt))
    rec = _Recorder(src.weights)
    load_rank_weights(build_graph(src.config, tp=2, rank=1), rec)
    sharded = [p for p in rec.parts if "proj" in p.source or "embed" in p.source or "lm_head" in p.source]
    assert sharded and all(p.dim in (0, 1) for p in sharded), "a sharded weight was read whole"
    full = {p.source: src.weights.shape(p.source) for p in sharded}
    assert all(p.stop - p.start < full[p.source][p.dim] or "k_proj" in p.source or "v_proj" in p.source
               for p in sharded)


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing weight"),
    (lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}), "unexpected tensor"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), r"expected shape \[64\], got \[3\]"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.float16)}), "expected dtype float32"),
])
def test_bad_checkpoints_get_clear_errors(tmp_path, hf_models, mutate, needle):
    ckpt, _ = hf_models["llama31-untied"]
    bad = _copy_ckpt(ckpt, tmp_path / "bad", mutate)
    with pytest.raises(CheckpointError, match=needle):
        open_model(str(bad))


def test_missing_shard_and_garbage_file(tmp_path, hf_models):
    ckpt, _ = hf_models["llama31-untied"]
    d = tmp_path / "idx"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    with pytest.raises(CheckpointError, match="listed in the index but missing"):
        SafetensorsSource(d)
    g = tmp_path / "garbage"
    g.mkdir()
    (g / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        SafetensorsSource(g)


def test_preset_materialises_deterministically(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    a = open_model("tiny", seed=3)
    assert (a.path / "model.safetensors").is_file() and a.path.is_relative_to(tmp_path)
    first = load_file(str(a.path / "model.safetensors"))
    (a.path / "model.safetensors").unlink()
    (a.path / "config.json").unlink()
    a.path.rmdir()
    b = open_model("tiny", seed=3)
    second = load_file(str(b.path / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
