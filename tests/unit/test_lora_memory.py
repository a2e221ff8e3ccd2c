"""The estimator's LoRA and DoRA activations and DoRA's weight-norm transient against what peft's
forward really saves (saved-tensor hooks) and allocates (the C allocator, op by op), on CPU."""

import ctypes
import ctypes.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lisaft.config.schema import recipe_from_dict
from lisaft.memory.counts import param_counts
from lisaft.memory.estimate import compute
from lisaft.memory.lora import lora_counts
from lisaft.memory.settings import recipe_for_model, settings_for_config
from lisaft.metrics.measure import saved_activations
from lisaft.model.parts import DTYPES

pytest.importorskip("peft")
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)


def _adapted(config, dtype: str, attention: str = "sdpa", **lora):
    from lisaft.model.lora import attach_adapters

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attention)
    recipe = recipe_from_dict({"model": {"name_or_path": "/nonexistent", "tokenizer": "t", "dtype": dtype},
                               "data": {"train": "t.jsonl"}, "lisa": {"enabled": False},
                               "lora": {"enabled": True, **lora}, "training": {"max_steps": 1, "output_dir": "r"}},
                              "r.yaml")
    attach_adapters(model, recipe)
    model.config.use_cache = False
    return model.train()


@pytest.mark.parametrize("dtype, lora, attention, checkpointing", [
    ("float32", {}, "sdpa", False),
    ("bfloat16", {"dora": True}, "sdpa", False),
    ("float32", {"dora": True, "target_modules": ["q_proj", "v_proj"]}, "sdpa", False),
    ("bfloat16", {"dora": True}, "eager", False),
    ("float32", {"dora": True, "dropout": 0.1}, "sdpa", False),
    ("float32", {"dora": True, "train_embeddings": True}, "sdpa", False),
    ("bfloat16", {"dora": True}, "sdpa", True),
])
def test_lora_activations_match_saved_tensor_meter(dtype, lora, attention, checkpointing):
    config = LlamaConfig(**CONFIG)
    model = _adapted(config, dtype, attention, rank=8, **lora)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    batch, seq = 2, 16
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    with saved_activations(model) as meter:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    keys = {"model.dtype": dtype, "model.attention": attention, "training.batch_size": batch, "data.max_seq_len": seq,
            "lora.enabled": True, "lora.rank": 8, **{f"lora.{k}": v for k, v in lora.items()}}
    est = compute(settings_for_config(config, {**keys, "model.gradient_checkpointing": checkpointing},
                                      device="cpu", full_rows=True))
    saved = est.saved_activation_bytes
    assert abs(saved - meter.bytes) <= 0.01 * meter.bytes, (saved, meter.bytes)
    if not checkpointing and lora.get("dora"):  # what DoRA adds is most of it: the test sees it
        plain_lora = {"lora.dora": False, "lora.dropout": 0.0, "lora.train_embeddings": False}
        plain = compute(est.settings.with_keys(plain_lora))
        assert saved > 1.2 * plain.saved_activation_bytes


@pytest.mark.parametrize("dora, dropout", [(False, 0.1), (True, 0.0), (True, 0.1)])
def test_qlora_activations_match_saved_tensor_meter(tmp_path, dora, dropout):
    """On a 4-bit base; DoRA with dropout runs the base matmul again on the dropped input, which
    keeps each dequantized weight (a bf16 copy of every adapted linear) for backward."""
    from lisaft.model.lora import attach_adapters, quantization_config

    config = LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    recipe = recipe_from_dict({"model": {"name_or_path": str(tmp_path / "base"), "tokenizer": "t", "dtype": "bfloat16",
                                         "quantize": "nf4"}, "data": {"train": "t.jsonl"}, "lisa": {"enabled": False},
                               "lora": {"enabled": True, "dora": dora, "dropout": dropout},
                               "training": {"max_steps": 1, "output_dir": "r"}}, "r.yaml")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantization_config(
        recipe.model), device_map={"": "cpu"}, dtype=torch.bfloat16)
    attach_adapters(model, recipe)
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with saved_activations(model) as meter:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    settings = settings_for_config(config, {
        "model.dtype": "bfloat16", "training.batch_size": 2, "data.max_seq_len": 16, "lora.enabled": True,
        "lora.rank": 8, "lora.dora": dora, "lora.dropout": dropout, "model.quantize": "nf4"}, device="cpu",
        full_rows=True)
    saved = compute(settings).saved_activation_bytes
    assert abs(saved - meter.bytes) <= 0.01 * meter.bytes, (saved, meter.bytes)
    if dora and dropout:
        weights = sum(m.in_features * m.out_features for m in model.model.layers[1].modules()
                      if type(m).__name__ == "Linear4bit")
        without = compute(settings.with_keys({"lora.dropout": 0.0}))
        assert saved - without.saved_activation_bytes > 2 * weights * len(model.model.layers[1:])


def _lora(dtype: str, **lora):
    """A recipe of adapters of rank 8 with the `lora` keys given."""
    return recipe_for_model("t", [f"model.dtype={dtype}", "lora.enabled=true", "lora.rank=8",
                                  *(f"lora.{k}={json.dumps(v)}" for k, v in lora.items())])


def _allocator_bytes():
    """Bytes glibc's malloc holds now (small blocks and mmapped ones), or None off glibc."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    return lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())


def test_dora_transient_is_what_its_weight_norm_allocates():
    """Inside each DoRA linear's forward, the allocator's high-water mark above what it held
    before, less the linear's own output, is the estimator's transient for that linear (the
    largest of them is what the estimate adds). float32 only: a bf16 matmul on CPU goes through
    oneDNN, which allocates and keeps its own conversion buffers, which CUDA does not have."""
    dtype = "float32"
    from torch.utils._python_dispatch import TorchDispatchMode

    held = _allocator_bytes()
    if held is None:
        pytest.skip("needs glibc's mallinfo2 to read the allocator")
    # Wide enough that malloc's own overhead (headers, page rounding) is under 1%.
    config = LlamaConfig(**{**CONFIG, "hidden_size": 256, "intermediate_size": 768, "head_dim": 64,
                            "num_hidden_layers": 1})
    model = _adapted(config, dtype, rank=8, dora=True)

    class HighWater(TorchDispatchMode):
        top = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.top = max(self.top, held())
            return out

    excess = {}
    mode = HighWater()

    def before(module, args):
        mode.top, module.held_before = 0, held()

    def after(module, args, out):
        excess[module.out_features] = mode.top - module.held_before - out.numel() * out.element_size()

    layer = model.model.layers[0]  # peft adapts the transformers model in place
    for linear in (layer.mlp.up_proj, layer.mlp.down_proj):
        linear.register_forward_pre_hook(before)
        linear.register_forward_hook(after)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with mode:
        model(input_ids=ids)
    dt = DTYPES[dtype].itemsize
    per = {}
    for name, fan_out in (("up_proj", 768), ("down_proj", 256)):
        per[name] = lora_counts(param_counts(config), config, _lora(dtype, dora=True, target_modules=[name]),
                                dt).transient
        assert abs(per[name] - excess[fan_out]) <= 0.01 * excess[fan_out], (name, per[name], excess[fan_out])
    # The in x in identity makes down_proj (the widest input) the worst, whatever its output size.
    everything = lora_counts(param_counts(config), config, _lora(dtype, dora=True), dt)
    assert everything.transient == per["down_proj"] > per["up_proj"]


def test_a_lora_runs_process_baseline_counts_importing_peft():
    """On CPU the process's own memory is part of the peak: a LoRA run imports peft, which imports
    bitsandbytes, even with a 32-bit optimizer (the figures: lisaft/memory/estimate.py)."""
    from lisaft.memory.estimate import BITSANDBYTES_IMPORT_BYTES, PEFT_IMPORT_BYTES

    config = LlamaConfig(**CONFIG)
    plain = compute(settings_for_config(config, device="cpu"))
    lora = compute(settings_for_config(config, {"lora.enabled": True}, device="cpu"))
    added = lora.components["process_baseline"] - plain.components["process_baseline"]
    assert added == BITSANDBYTES_IMPORT_BYTES + PEFT_IMPORT_BYTES
    eight_bit = compute(settings_for_config(config, {"lora.enabled": True, "optimizer.name": "adamw_8bit"},
                                            device="cpu"))
    assert eight_bit.components["process_baseline"] == lora.components["process_baseline"]  # imported once
