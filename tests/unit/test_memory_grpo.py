"""The estimator's GRPO terms: the KV cache against a hand computation for Llama-3.1-8B, the two
peaks of the shipped GRPO recipes (the full-parameter one at most 21.5 GiB at both, the LoRA one
with β > 0 within 24 GiB), what each setting moves, and the text and JSON that say them."""

import re
from dataclasses import replace
from pathlib import Path

import pytest

from lisaft.config.schema import load_recipe
from lisaft.memory.activations import shape_from_config
from lisaft.memory.command import settings_from_recipe
from lisaft.memory.estimate import compute
from lisaft.memory.generation import kv_bytes_per_token
from lisaft.memory.grpo import grpo_lines, grpo_summary

REPO = Path(__file__).resolve().parents[2]
FULL = REPO / "recipes" / "llama3.1-8b-grpo-24gb.yaml"
LORA = REPO / "recipes" / "llama3.1-8b-lora-grpo-24gb.yaml"
GiB = 2**30
TARGET = 21.5 * GiB


@pytest.fixture(scope="module")
def full():
    return settings_from_recipe(load_recipe(FULL)).with_(host_budget_bytes=64 * GiB)


def test_the_kv_cache_is_layers_times_k_and_v_times_kv_heads_times_head_dim_times_bytes(full):
    # Llama-3.1-8B: 32 layers, 8 kv heads of 128, bfloat16.
    per_token = 32 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(shape_from_config(full.config), 2) == per_token == 131_072
    g = compute(full).generation
    # 2 completions a micro-batch x 4 micro-batches a generation, each 512 prompt + 1024 completion tokens.
    assert (g.sequences, g.prompt_tokens, g.completion_tokens) == (8, 512, 1024)
    # The last token is sampled and never fed back: the cache holds one fewer.
    assert g.kv_cache == 8 * (512 + 1024 - 1) * per_token
    assert compute(full.with_keys({"grpo.steps_per_generation": 8})).generation.kv_cache == 2 * g.kv_cache


def test_the_8b_recipe_is_full_parameter_beta_0_cpu_offload_g_8_and_under_21_5_gib_at_both_peaks(full):
    r = full.recipe
    assert not r.lora.enabled and not r.lisa.enabled and r.optimizer.cpu_offload and r.grpo.beta == 0
    assert r.grpo.num_generations == 8 and r.grpo.max_completion_length == 1024
    assert r.data.max_seq_len - r.grpo.max_completion_length == 512
    est = compute(full)
    p = grpo_summary(est)
    assert p["generation_peak_bytes"] <= TARGET and p["training_peak_bytes"] <= TARGET, p
    assert est.total_bytes == max(p["generation_peak_bytes"], p["training_peak_bytes"]) and est.fits
    assert "scoring_pass" not in est.phases and p["reference_weights_bytes"] == 0
    # The host RAM the header states is the estimator's host figure.
    header = FULL.read_text().split("\nmodel:")[0]
    stated = int(re.search(r"about (\d+) GiB of RAM", header).group(1))
    assert round(est.host_bytes / GiB) == stated and est.fits_host


def test_the_lora_recipe_has_beta_above_0_scores_its_reference_once_and_fits_24_gib():
    s = settings_from_recipe(load_recipe(LORA))
    assert s.recipe.lora.enabled and s.recipe.grpo.beta > 0
    est = compute(s)
    assert est.fits and est.budget_bytes == 24 * GiB
    p = grpo_summary(est)
    # The reference is the base with the adapters off: scored in a pass, never a second copy.
    assert p["scoring_pass_bytes"] is not None and p["reference_weights_bytes"] == 0
    assert max(p["generation_peak_bytes"], p["training_peak_bytes"], p["scoring_pass_bytes"]) == est.total_bytes


def test_what_each_setting_moves(full):
    base = compute(full)
    # β > 0 without adapters: the frozen copy of the weights, at every moment, and a scoring pass.
    ref = compute(full.with_keys({"grpo.beta": 0.04}))
    assert ref.generation.reference_weights == base.weights_bytes
    assert all(ref.phase_components[k]["reference_weights"] == base.weights_bytes for k in ref.phases)
    assert "scoring_pass" in ref.phases and "reference's" in ref.generation.scoring_why
    # A generation that outlives its step keeps the old policy's log-probs: a scoring pass.
    assert "old policy" in compute(full.with_keys({"grpo.num_iterations": 3})).generation.scoring_why
    # Filters add sampling buffers; the generation's memory is nothing at the training moments.
    assert compute(full.with_keys({"grpo.top_p": 0.9})).generation.sampling_logits > base.generation.sampling_logits
    assert base.phase_components["layer_backward"]["kv_cache"] == 0
    assert base.phase_components["generation"]["gradients"] == 0


def test_the_text_says_both_peaks_and_explain_shows_the_arithmetic(full):
    est = compute(full)
    short = " ".join(grpo_lines(est))
    assert "two peaks" in short and "The generation is higher; the fit verdict uses it" in short
    assert "KV cache 1.50 GiB" in short and "32 layers" not in short
    explained = " ".join(grpo_lines(est, explain=True))
    assert "32 layers x 2 (K, V) x 8 kv heads x 128 x 2 bytes = 131,072 bytes a token; x 8 sequences" in explained
    assert "x (512 + 1024 - 1) tokens" in explained and "= 1.50 GiB" in explained
    assert "No scoring pass" in explained
    # Without a grpo section nothing is said and --json's `grpo` is null.
    sft = compute(replace(full, recipe=full.recipe.model_copy(update={"grpo": None})))
    assert grpo_lines(sft, explain=True) == [] and grpo_summary(sft) is None and sft.generation is None
    assert "kv_cache" not in sft.components


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kv_cache_is_what_transformers_generate_holds(dtype):
    """A tiny Llama's DynamicCache after `generate` (every completion run to its end): the
    estimator's kv_cache, byte for byte."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from lisaft.memory.settings import settings_for_config

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    prompt, completion, sequences = 7, 5, 3
    s = settings_for_config(config, {
        "data.format": "prompts", "data.max_seq_len": prompt + completion, "model.dtype": dtype,
        "grpo.reward_funcs": ["exact_match"], "grpo.num_generations": sequences,
        "grpo.max_completion_length": completion, "training.batch_size": sequences}, device="cpu")
    g = compute(s).generation
    assert (g.sequences, g.prompt_tokens) == (sequences, prompt)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    ids = torch.randint(3, 64, (sequences, prompt))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
        do_sample=True, max_new_tokens=completion, min_new_tokens=completion, pad_token_id=0, eos_token_id=2,
        return_dict_in_generate=True))
    assert out.sequences.shape == (sequences, prompt + completion)
    assert sum(layer.keys.nbytes + layer.values.nbytes for layer in out.cache.layers) == g.kv_cache


def test_advice_offers_one_group_at_a_time_when_the_generation_does_not_fit(full):
    """32 sequences a generation (a 6 GiB cache) put the generation over a 20 GiB budget: the advice
    samples one group at a time, which `lisaft train` accepts."""
    from lisaft.config.compat import first_exclusion
    from lisaft.memory.advice import advice

    big = full.with_keys({"grpo.steps_per_generation": 16}).with_(budget_bytes=20 * GiB)
    est = compute(big)
    assert not est.fits and est.peak_phase == "generation"
    rows = advice(est, 32)
    one_group = next(c for c in rows if c.overrides == {"grpo.steps_per_generation": 4})
    assert one_group.estimate.fits and "one group of 8" in one_group.why
    assert all(first_exclusion(big.with_keys(c.overrides).recipe) is None for c in rows)
    # The largest batch offered is whole groups a generation: even, at 4 micro-batches a generation of G 8.
    from lisaft.memory.advice import largest_fitting

    largest = largest_fitting(full, "training.batch_size")
    assert largest % 2 == 0 and first_exclusion(full.with_keys({"training.batch_size": largest}).recipe) is None
    assert not compute(full.with_keys({"training.batch_size": largest + 2})).fits
