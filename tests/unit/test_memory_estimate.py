"""The estimator's arithmetic: hand-computed figures, exact parameter counts, monotonicity,
paging, and the shipped 24 GiB recipe."""

from pathlib import Path

import pytest
from transformers import LlamaConfig

from lisaft.errors import LisaftError
from lisaft.memory.catalogue import catalogue_names, resolve_model
from lisaft.memory.command import parse_bytes, settings_from_recipe
from lisaft.memory.counts import param_counts
from lisaft.memory.estimate import CPU_PROCESS_BASELINE_BYTES, GiB, MiB, compute
from lisaft.memory.optimizer_state import QMAP_BYTES, state_bytes, tensor_state
from lisaft.memory.settings import settings_for_config

REPO = Path(__file__).resolve().parents[2]


def _hand_config():
    # h=8, i=16, 2 heads of 4, 1 kv head, 2 layers, vocab 32, untied.
    return LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                       num_hidden_layers=2, vocab_size=32, max_position_embeddings=64,
                       tie_word_embeddings=False)


def test_hand_computed_tiny_config():
    s = settings_for_config(_hand_config(), {"model.dtype": "float32", "model.attention": "sdpa",
                                             "optimizer.name": "adamw_32bit", "training.batch_size": 1,
                                             "data.max_seq_len": 4}, device="cpu", budget_bytes=GiB)
    e = compute(s)
    # per layer: q 64 + k 32 + v 32 + o 64 + gate/up/down 3*128 + two norms 16 = 592
    # embeddings 256 + head 256 + final norm 8
    assert e.total_params == 2 * 592 + 256 + 256 + 8 == 1704
    # + the rotary tables inv_freq and original_inv_freq, 2 float32 each
    assert e.weights_bytes == 1704 * 4 + 2 * 2 * 4
    # 4 tokens against a 32-token vocabulary: the embedding's gradient is sparse, a float32 row
    # and an int64 index per token, twice while rows are summed, instead of 32 x 8 floats
    sparse_saving = 256 * 4 - 2 * 4 * (8 * 4 + 8)
    assert e.grad_bytes == 1704 * 4 - sparse_saving
    assert compute(s.with_keys({"model.sparse_embedding_grad": False})).grad_bytes == 1704 * 4
    # two float32 moments per parameter (the step count is a Python int)
    assert e.optimizer_state_bytes == 2 * 4 * 1704
    # per layer per token: norms 2*(4*8+4+4*8) + norm outputs 2*4*8 + q,k,v,out 4*(8+4+4+8)
    # + log-sum-exp 4*2 + MLP 4*4*16 = 560; outside: ids 8*4, cos/sin 2*4*4*4, final norm
    # 68*4, head input 32*4; loss: log-probs 4*(4*32+8) + 4
    assert e.saved_activation_bytes == 560 * 2 * 4 + (32 + 128 + 272 + 128) + 548
    # the optimizer step is the peak: weights + moments + every gradient + clipping norms
    # + the embedding's sparse gradient made dense one float32 chunk at a time (256 elements,
    # 4 B each); float32 weights with dense gradients step in place
    assert e.peak_phase == "optimizer_step"
    assert e.total_bytes == 6832 + 13632 + 6816 - sparse_saving + 8 * 21 + 4 * 256 + CPU_PROCESS_BASELINE_BYTES
    assert sum(e.components.values()) == e.total_bytes


def test_llama_31_8b_exact_parameter_count():
    config, label = resolve_model("llama-3.1-8b")
    assert label == "llama-3.1-8b"
    assert param_counts(config).total == 8_030_261_248


@pytest.mark.parametrize("name,count", [
    ("llama-3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768), ("mistral-7b-v0.3", 7_248_023_552),
])
def test_catalogue_counts_match_published(name, count):
    assert param_counts(resolve_model(name)[0]).total == count


def test_catalogue_has_the_promised_models():
    assert {"llama-3.1-8b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-70b", "mistral-7b-v0.3",
            "qwen2.5-0.5b", "qwen2.5-7b", "gemma-2-9b", "phi-3-mini"} <= set(catalogue_names())


def test_placeholder_paths_and_hub_ids_map_to_the_catalogue():
    assert resolve_model("/path/to/Meta-Llama-3.1-8B")[1] == "llama-3.1-8b"
    assert resolve_model("meta-llama/Llama-3.2-1B-Instruct")[1] == "llama-3.2-1b"


def test_tied_embeddings_count_once():
    counts = param_counts(resolve_model("llama-3.2-1b")[0])
    assert counts.tied and sum(counts.head) == 2048  # only the final norm is left in the head


def test_eight_bit_state_follows_bitsandbytes_layout():
    # small tensors keep float32 moments
    assert tensor_state("adamw_8bit", 4095, 2, "cpu").total == 8 * 4095
    # uint8 moments + one float32 absmax per 256-element block, per moment
    assert tensor_state("adamw_8bit", 5000, 2, "cpu").total == 2 * 5000 + 2 * 4 * 20
    assert state_bytes("adamw_8bit", [5000, 100], 2, "cpu").total == 10160 + 800 + QMAP_BYTES
    # paging on CUDA only, and only for tensors of at least 1e5 elements
    assert tensor_state("paged_adamw_8bit", 200_000, 2, "cuda").paged == 400_000
    assert tensor_state("paged_adamw_8bit", 50_000, 2, "cuda").paged == 0
    assert tensor_state("paged_adamw_32bit", 200_000, 2, "cpu").paged == 0
    # 32-bit moments are float32 whatever the weights: lisaft's AdamW and bitsandbytes alike
    assert tensor_state("adamw_32bit", 1000, 2, "cuda").total == 8 * 1000
    assert tensor_state("paged_adamw_32bit", 1000, 2, "cuda").total == 8 * 1000


def _small(keys=None):
    return settings_for_config(resolve_model("llama-3.2-1b")[0], {"data.max_seq_len": 512, **(keys or {})})


@pytest.mark.parametrize("opt", ["adamw_32bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_more_tokens_or_gamma_never_cost_less(opt, ckpt):
    s = _small({"optimizer.name": opt, "model.gradient_checkpointing": ckpt})
    by_seq = [compute(s.with_keys({"data.max_seq_len": n})).total_bytes for n in (128, 256, 1024, 4096)]
    by_batch = [compute(s.with_keys({"training.batch_size": b})).total_bytes for b in (1, 2, 4)]
    by_gamma = [compute(s.with_keys({"lisa.enabled": True, "lisa.active_layers": g})).total_bytes
                for g in (1, 2, 4, 8, 16)]
    full = compute(s).total_bytes
    assert by_seq == sorted(by_seq) and by_batch == sorted(by_batch) and by_gamma == sorted(by_gamma)
    assert by_gamma[-1] <= full


def test_more_layers_never_cost_less():
    totals = []
    for layers in (2, 4, 8):
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=layers, vocab_size=1000)
        for lisa in (False, True):
            totals.append((lisa, compute(settings_for_config(cfg, {"lisa.enabled": lisa})).total_bytes))
    for lisa in (False, True):
        seq = [t for flag, t in totals if flag == lisa]
        assert seq == sorted(seq)


def test_checkpointing_eager_and_in_backward_help():
    s = _small({"data.max_seq_len": 2048})
    checkpointed = s.with_keys({"model.gradient_checkpointing": True})
    assert compute(checkpointed).sizes["activations"] < compute(s).sizes["activations"]
    assert compute(s.with_keys({"model.attention": "eager"})).total_bytes > compute(s).total_bytes
    ib = compute(s.with_keys({"optimizer.in_backward": True, "training.max_grad_norm": None}))
    # no full gradient set; only the bounded update chunk (48 MiB, + 2% reserve) meets the activations
    assert "optimizer_step" not in ib.phases and ib.total_bytes <= compute(s).total_bytes + 49 * MiB


def test_paged_state_split_under_budget():
    config, _ = resolve_model("llama-3.1-8b")
    e = compute(settings_for_config(config, {"optimizer.name": "paged_adamw_32bit",
                                             "model.gradient_checkpointing": True,
                                             "optimizer.in_backward": True, "training.max_grad_norm": None}))
    assert e.paged_state_bytes > 50 * GiB
    assert e.paged_gpu_bytes + e.paged_host_bytes == e.paged_state_bytes
    assert not e.fits and e.paged_host_bytes > 0
    # the same on CPU: nothing is paged
    cpu = compute(settings_for_config(config, {"optimizer.name": "paged_adamw_32bit"}, device="cpu"))
    assert cpu.paged_state_bytes == 0


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * GiB
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512 MiB") == 512 * MiB
    assert parse_bytes("16G") == 16 * GiB
    with pytest.raises(LisaftError, match="--budget"):
        parse_bytes("lots")


def test_shipped_24gb_recipe_fits_with_nothing_paged():
    from lisaft.config.schema import load_recipe

    recipe = load_recipe(REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml")
    assert recipe.optimizer.name == "paged_adamw_8bit" and recipe.lisa.enabled
    assert recipe.model.attention == "flash_attention_2" and recipe.model.gradient_checkpointing
    e = compute(settings_from_recipe(recipe, device="cuda", budget_bytes=24 * GiB))
    assert e.settings.model_label == "llama-3.1-8b"
    assert e.fits and e.paged_host_bytes == 0


def test_loss_buffers_follow_the_chunked_loss():
    config, _ = resolve_model("llama-3.1-8b")
    s = settings_for_config(config, {"model.dtype": "bfloat16", "lisa.enabled": True,
                                     "optimizer.name": "paged_adamw_8bit", "model.gradient_checkpointing": True,
                                     "data.max_seq_len": 2048})
    est = compute(s)
    chunk = (1 << 24) // 128256
    assert chunk == 130
    # One chunk's float32 log-probs (which become its gradient) beside its recomputed bf16
    # logits, not 12 B x 2048 x 128256.
    assert est.sizes["logits_loss"] == chunk * 128256 * (4 + 2)
    small = compute(s.with_keys({"data.max_seq_len": 64}))  # 64 x 128256 < 2^24: unchunked
    assert small.sizes["logits_loss"] == 64 * 128256 * (4 + 2)  # the gradient and its bf16 cast


def test_model_layers_path_reaches_the_estimator(tmp_path):
    """An architecture whose decoder layers lisaft cannot find: the recipe's model.layers_path
    is what the estimate (estimate-memory and the end-of-run table) counts layers by."""
    from transformers import OPTConfig

    from lisaft.config.schema import recipe_from_dict
    from lisaft.memory.command import estimate_for_recipe

    config = OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=3, num_attention_heads=4,
                       max_position_embeddings=64, word_embed_proj_dim=32)
    with pytest.raises(LisaftError, match="set model.layers_path"):
        param_counts(config)
    assert param_counts(config, "model.decoder.layers").layer_count == 3
    config.save_pretrained(tmp_path / "opt")
    recipe = recipe_from_dict({
        "model": {"config": str(tmp_path / "opt"), "tokenizer": "unused", "layers_path": "model.decoder.layers"},
        "data": {"train": "unused.jsonl", "max_seq_len": 16},
        "lisa": {"enabled": True, "active_layers": 1},
        "training": {"max_steps": 1, "output_dir": str(tmp_path / "run")}})
    est = estimate_for_recipe(recipe, device="cpu")
    assert est.trainable_params < est.total_params  # LISA counted one of the three layers
