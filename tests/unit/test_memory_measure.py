"""Estimated vs measured at tiny scale: saved-tensor activations, tensor bytes, peaks."""

import io
import warnings

import pytest
import torch
from rich.console import Console
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from lisaft.memory import estimated_vs_measured_table
from lisaft.memory.estimate import compute
from lisaft.memory.settings import settings_for_config
from lisaft.metrics.measure import (
    grad_bytes,
    optimizer_state_bytes,
    peak_memory,
    peak_rss_bytes,
    saved_activations,
    tensor_bytes,
    weight_bytes,
)
from lisaft.model.parts import DTYPES, model_parts

_BASE = dict(hidden_size=32, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3, vocab_size=96, max_position_embeddings=128)
_FAMILY = {"llama": {}, "qwen2": {}, "gemma2": dict(head_dim=16, query_pre_attn_scalar=16),
           "phi3": dict(pad_token_id=0)}


def _model(model_type, dtype, attention, checkpointing, gamma):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **_BASE, **_FAMILY[model_type], tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attention)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    if gamma:
        for i, layer in enumerate(model_parts(model).layers):
            layer.requires_grad_(i == 1)
    return config, model


@pytest.mark.parametrize("model_type,dtype,attention,checkpointing,gamma", [
    ("llama", "float32", "sdpa", False, 0),
    ("llama", "bfloat16", "sdpa", False, 1),
    ("llama", "float32", "eager", False, 0),
    ("llama", "bfloat16", "sdpa", True, 0),
    ("qwen2", "bfloat16", "eager", False, 1),
    ("gemma2", "float32", "eager", False, 0),
    ("phi3", "bfloat16", "sdpa", False, 1),
])
def test_activations_match_saved_tensor_meter(model_type, dtype, attention, checkpointing, gamma):
    config, model = _model(model_type, dtype, attention, checkpointing, gamma)
    batch, seq = 2, 20
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with saved_activations(model) as meter:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    est = compute(settings_for_config(config, {
        "model.dtype": dtype, "model.attention": attention, "model.gradient_checkpointing": checkpointing,
        "lisa.enabled": bool(gamma), "lisa.active_layers": gamma or 2, "training.batch_size": batch,
        "data.max_seq_len": seq}, device="cpu", full_rows=True))
    assert meter.bytes > 0
    assert abs(est.saved_activation_bytes - meter.bytes) <= 0.01 * meter.bytes


@pytest.mark.parametrize("model_type,dtype,attention,checkpointing", [
    ("llama", "float32", "sdpa", False),
    ("llama", "bfloat16", "sdpa", False),
    ("llama", "bfloat16", "sdpa", True),
    ("qwen2", "bfloat16", "eager", False),
])
def test_packed_rows_activations_match_saved_tensor_meter(model_type, dtype, attention, checkpointing):
    from lisaft.data.collate import collate
    from lisaft.model.attention import model_inputs

    config, model = _model(model_type, dtype, attention, checkpointing, 0)
    seq = 40
    rows = [{"input_ids": torch.randint(0, config.vocab_size, (seq,)).tolist(), "doc_lens": lens}
            for lens in ([15, 25], [10, 10, 20])]
    for row in rows:
        row["labels"] = row["input_ids"]
    batch = collate(rows, pad_id=0)
    with saved_activations(model) as meter:
        loss = model(**model_inputs(batch), labels=batch["labels"]).loss
    loss.backward()
    settings = settings_for_config(config, {
        "model.dtype": dtype, "model.attention": attention, "model.gradient_checkpointing": checkpointing,
        "training.batch_size": 2, "data.max_seq_len": seq, "data.packing": True}, device="cpu")
    est = compute(settings)
    assert abs(est.saved_activation_bytes - meter.bytes) <= 0.01 * meter.bytes
    mask = 2 * seq * seq * DTYPES[dtype].itemsize if attention == "sdpa" else 0
    unpacked = settings.with_keys({"data.packing": False}).with_(full_rows=True)
    assert est.sizes["activations"] - compute(unpacked).sizes["activations"] >= mask

@pytest.mark.parametrize("dtype,checkpointing", [("float32", False), ("bfloat16", True)])
def test_packed_rows_of_one_document_each_keep_no_mask(dtype, checkpointing):
    """Packed rows that are each one whole document carry no position ids: sdpa runs is_causal,
    with no mask and grouped k, v unrepeated. The estimate for full rows sees what is kept; the
    one for rows of several documents counts the mask on top."""
    from lisaft.data.collate import collate
    from lisaft.model.attention import model_inputs

    config, model = _model("llama", dtype, "sdpa", checkpointing, 0)
    seq = 40
    rows = [{"input_ids": torch.randint(0, config.vocab_size, (seq,)).tolist(), "doc_lens": [seq]} for _ in range(2)]
    for row in rows:
        row["labels"] = row["input_ids"]
    batch = collate(rows, pad_id=0)
    assert "position_ids" not in batch
    with saved_activations(model) as meter:
        loss = model(**model_inputs(batch), labels=batch["labels"]).loss
    loss.backward()
    settings = settings_for_config(config, {
        "model.dtype": dtype, "model.attention": "sdpa", "model.gradient_checkpointing": checkpointing,
        "training.batch_size": 2, "data.max_seq_len": seq, "data.packing": True}, device="cpu")
    full = compute(settings.with_(full_rows=True))
    assert abs(full.saved_activation_bytes - meter.bytes) <= 0.01 * meter.bytes
    mask = 2 * seq * seq * DTYPES[dtype].itemsize
    assert compute(settings).sizes["activations"] - full.sizes["activations"] >= mask


@pytest.mark.parametrize("dtype,attention,gamma,kv_heads", [
    ("float32", "sdpa", 0, 4), ("bfloat16", "sdpa", 1, 4), ("float32", "eager", 0, 4),
    ("float32", "sdpa", 0, 2), ("float32", "sdpa", 1, 1), ("bfloat16", "sdpa", 0, 2), ("bfloat16", "sdpa", 1, 1),
])
def test_padded_rows_keep_one_mask_and_repeated_kv_under_sdpa(dtype, attention, gamma, kv_heads):
    """Rows padded to the longest of the batch (no packing): SDPA keeps an additive mask per
    layer, and with grouped K/V heads the k and v repeated to every head; the estimate for padded
    rows must see them, the one for full rows must not. lisaft's forward hands sdpa one additive
    mask shared by the layers (doc_attention.share_sdpa_mask), as here."""
    from lisaft.model.attention import share_sdpa_mask

    share_sdpa_mask()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(**{**_BASE, "num_key_value_heads": kv_heads}, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attention)
    model.train()
    if gamma:
        for i, layer in enumerate(model_parts(model).layers):
            layer.requires_grad_(i == 1)
    batch, seq = 3, 24
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    mask = torch.ones_like(ids)
    mask[1:, 16:] = 0
    with saved_activations(model) as meter:
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    # No data.packing: rows are padded to the longest of the batch.
    settings = settings_for_config(config, {
        "model.dtype": dtype, "model.attention": attention, "lisa.enabled": bool(gamma),
        "lisa.active_layers": gamma or 2, "training.batch_size": batch, "data.max_seq_len": seq}, device="cpu")
    padded = compute(settings).saved_activation_bytes
    assert abs(padded - meter.bytes) <= 0.01 * meter.bytes
    if attention == "sdpa" and kv_heads == config.num_attention_heads:
        full = compute(settings.with_(full_rows=True)).saved_activation_bytes  # nothing to hide, no mask
        assert padded - full == batch * seq * seq * DTYPES[dtype].itemsize


def test_meter_counts_views_once_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    with saved_activations() as meter:
        meter.exclude = {w.untyped_storage().data_ptr()}
        y = x * 2
        z = (y[:2] * y[2:]).sum() + (y @ w).sum()
    assert meter.bytes == 4 * 16 * 4  # y once, though saved through two views; w skipped
    z.backward()


def test_meter_forgets_what_a_dropped_branch_saved():
    # DoRA's weight norm: B(A(I)) is built on the graph, then only its detached value is used, so
    # the identity A saved is freed before backward and is no activation.
    x = torch.randn(16, 16, requires_grad=True)
    with saved_activations() as meter:
        dropped = (x * 3) @ (x * 2)  # saves both products, freed with `dropped`
        del dropped
        kept = x.exp()  # saves its 16 x 16 output
    assert meter.bytes == 16 * 16 * 4
    kept.sum().backward()


@pytest.mark.parametrize("opt_name", ["adamw_32bit", "adamw_8bit"])
def test_tensor_bytes_match_estimate(opt_name):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    from lisaft.config.schema import OptimizerSection
    from lisaft.optim.adamw import Rounding
    from lisaft.optim.build import build_unit_optimizer

    opt = build_unit_optimizer(list(model.parameters()), OptimizerSection(name=opt_name, lr=1e-3),
                               torch.device("cpu"), Rounding("stochastic", 0), 0, None)
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    measured = {"weights_bytes": weight_bytes(model), "grad_bytes": grad_bytes(model)}
    opt.step()
    # The two 8-bit code books are shared by every unit, outside any optimizer's state.
    measured["optimizer_state_bytes"] = optimizer_state_bytes(opt) + (2 * 256 * 4 if opt_name == "adamw_8bit" else 0)
    est = compute(settings_for_config(config, {"model.dtype": "float32", "optimizer.name": opt_name}, device="cpu"))
    assert est.weights_bytes == measured["weights_bytes"]
    assert est.grad_bytes == measured["grad_bytes"]
    assert est.optimizer_state_bytes == measured["optimizer_state_bytes"]
    measured.update(activation_bytes=None, peak_bytes=peak_rss_bytes())
    text = _render(estimated_vs_measured_table(est, measured))
    assert "optimizer states" in text and "+0.0%" in text


def test_tensor_bytes_dedupes_shared_storage():
    a = torch.zeros(10)
    assert tensor_bytes([a, a[:5], a.view(2, 5)]) == 40


def test_peaks_on_cpu():
    from lisaft.metrics.measure import current_rss_bytes

    MiB = 2**20
    now = current_rss_bytes()
    before = peak_memory("cpu").rss_bytes
    # Bytes, as the current RSS is (ru_maxrss is KiB on Linux); the two count shared pages a
    # little differently, hence the slack.
    assert now - 16 * MiB <= before < 64 * now
    # Raise the peak by at least 128 MiB above the one so far, then free it: the figure must be
    # the peak, not what the process holds now.
    grow = before - now + 128 * MiB
    held = torch.ones(grow // 4, dtype=torch.float32)  # written, so resident
    del held
    p = peak_memory("cpu")
    assert p.rss_bytes >= before + 96 * MiB
    assert p.rss_bytes >= current_rss_bytes() + 96 * MiB
    assert p.cuda_allocated_bytes is None and p.cuda_reserved_bytes is None


def _render(table) -> str:
    buf = io.StringIO()
    Console(file=buf, width=120).print(table)
    return buf.getvalue()


def test_memory_counters_name_what_they_count():
    from lisaft.metrics.measure import memory_counters, nvml_used_bytes, peak_rss_bytes

    rec = memory_counters(torch.device("cpu"))
    assert rec["peak_memory_counter"] == "process_peak_rss"
    assert 0 < rec["peak_memory_bytes"] <= peak_rss_bytes()
    assert "nvml_used_bytes" not in rec and nvml_used_bytes("cpu") is None
