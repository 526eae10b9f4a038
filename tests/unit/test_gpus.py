from __future__ import annotations

import pytest

from gearshift.facts.gpus import GPU_SPECS, UnknownGPUError, compute_score, gpu_spec, pd_gpu_prior


def test_reference_card_scores_one_and_order_follows_tflops():
    assert compute_score("H100-80GB") == 1.0
    assert compute_score("A100-40GB") == pytest.approx(312 / 989)
    ordered = sorted(GPU_SPECS, key=compute_score)
    tflops = [GPU_SPECS[m].bf16_tflops for m in ordered]
    assert tflops == sorted(tflops)


def test_lookup_by_feature_discovery_product_name():
    assert gpu_spec("NVIDIA-A10").model == "A10-24GB"
    assert gpu_spec("tesla-t4").memory_gib == 16


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownGPUError, match="H100-80GB"):
        gpu_spec("GTX-480")


def test_pd_prior_from_seed_000():
    assert pd_gpu_prior("H800-80GB") == 0.95
    assert pd_gpu_prior("T4-16GB") == 0.5
