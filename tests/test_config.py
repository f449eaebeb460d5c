"""config.json parsing: transformers 4.x and 5.x forms, and clear refusals."""

from __future__ import annotations

import json

import pytest

from mpk_dist.config import config_from_dict, load_config
from mpk_dist.errors import ConfigError

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def test_v4_and_v5_forms_give_the_same_config():
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    v4 = config_from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
                           "rope_scaling": {"rope_type": "llama3", **rope}, "torch_dtype": "bfloat16"})
    v5 = config_from_dict({**BASE, "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16",
                           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **rope}})
    assert v4 == v5
    assert v4.rope.rope_type == "llama3" and v4.rope.theta == 500000.0 and v4.rope.factor == 8.0


def test_qwen3_head_dim_independent_of_hidden():
    cfg = config_from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert cfg.head_dim == 32 and cfg.family == "qwen3" and cfg.has_qk_norm


def test_round_trip_through_to_hf_dict():
    cfg = config_from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32, "eos_token_id": 7})
    assert config_from_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("patch, needle", [
    ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"torch_dtype": "int8"}, "dtype"),
    ({"num_key_value_heads": 3}, "multiple"),
])
def test_unsupported_configs_are_named(patch, needle):
    d = {**BASE, "architectures": ["LlamaForCausalLM"], **patch}
    with pytest.raises(ConfigError, match=needle):
        config_from_dict(d)


def test_missing_and_unreadable_config(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config(tmp_path)
