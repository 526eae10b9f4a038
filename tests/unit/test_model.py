"""The shared cost formulas against published parameter counts (model cards), not against themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

from gearshift.facts.model import ModelConfigError, arch_from_hf_config, load_hf_config

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"


@pytest.mark.parametrize(
    ("file", "published_params"),
    [
        ("llama-3-8b.json", 8.03e9),  # Meta Llama 3 model card: 8.03B
        ("llama-3-70b.json", 70.6e9),  # Meta Llama 3 model card: 70.6B
        ("qwen2.5-7b.json", 7.61e9),  # Qwen2.5-7B model card: 7.61B
        ("mixtral-8x7b.json", 46.7e9),  # Mistral AI, "Mixtral of experts" (2023): 46.7B total
    ],
)
def test_total_parameters_match_model_cards(file, published_params):
    arch = load_hf_config(MODELS / file)
    params = arch.total_weight_bytes / arch.dtype_bytes
    assert params == pytest.approx(published_params, rel=0.01)


def test_mixtral_active_parameters_match_paper():
    # "Mixtral of experts": 12.9B active parameters per token (13B with embeddings counted once).
    arch = load_hf_config(MODELS / "mixtral-8x7b.json")
    active = arch.num_layers * (arch.attn_params + arch.active_mlp_params) + arch.embedding_bytes / 2
    assert active == pytest.approx(12.9e9, rel=0.02)


def test_llama3_8b_kv_cache_per_token():
    # 32 layers × 2 (K and V) × 8 KV heads × 128 head dim × 2 bytes = 131072 bytes = 128 KiB.
    arch = load_hf_config(MODELS / "llama-3-8b.json")
    assert arch.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert arch.activation_bytes_per_token == 4096 * 2


def test_flops_per_token_is_twice_active_params_plus_attention():
    arch = load_hf_config(MODELS / "llama-3-8b.json")
    per_layer_params = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert arch.layer_flops_per_token(0) == 2 * per_layer_params
    assert arch.layer_flops_per_token(1000) - arch.layer_flops_per_token(0) == 4 * 32 * 128 * 1000


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"torch_dtype": "float128"}, "torch_dtype"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ],
)
def test_bad_config_names_the_field(patch, field):
    cfg = {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
    } | patch
    with pytest.raises(ModelConfigError, match=field):
        arch_from_hf_config(cfg)
