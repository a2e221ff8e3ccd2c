"""LoRA's recipe rules, its units (the frozen base in none), the estimator's adapter and 4-bit
terms against the model peft and bitsandbytes build, and bitsandbytes' CPU repacking kept off."""

import pytest
import torch
from _tiny import tiny

from lisaft.config.schema import recipe_from_dict
from lisaft.errors import LisaftError

BASE = {
    "model": {"name_or_path": "/nonexistent/base", "tokenizer": "tok"},
    "data": {"train": "train.jsonl"},
    "lora": {"enabled": True},
    "training": {"max_steps": 2, "output_dir": "run"},
}


def _recipe(**changes):
    data = {k: dict(v) for k, v in BASE.items()}
    for key, value in changes.items():
        section, name = key.split("__")
        data.setdefault(section, {})[name] = value
    return recipe_from_dict(data, "r.yaml")


def test_defaults_are_the_peers_documented_ones():
    lora = _recipe().lora
    assert (lora.rank, lora.scale_alpha, lora.dropout, lora.target_modules) == (8, 16.0, 0.0, "all-linear")
    assert not lora.dora and not lora.train_embeddings and lora.export == "merged"


@pytest.mark.parametrize("changes, words", [
    ({"lisa__enabled": True}, "lisa.enabled"),
    ({"lora__enabled": False, "model__quantize": "nf4"}, "model.quantize"),
    ({"training__fsdp": True}, "training.fsdp"),
    ({"optimizer__cpu_offload": True}, "optimizer.cpu_offload"),
    ({"lora__export": "adapter", "lora__train_embeddings": True}, "lora.export"),
    ({"model__quantize": "nf4", "model__name_or_path": None, "model__config": "c.json"}, "model.config"),
    ({"lora__rank": 0}, "lora.rank"),
])
def test_senseless_combinations_are_refused_in_one_line(changes, words):
    with pytest.raises(LisaftError) as e:
        _recipe(**changes)
    assert words in str(e.value) and "\n" not in str(e.value)


def _adapted(lora=None, quantize=False):
    from lisaft.model.lora import attach_adapters

    model = tiny()
    recipe = _recipe(model__dtype="float32", **(lora or {}))
    return model, attach_adapters(model, recipe), recipe


def test_the_frozen_base_is_in_no_unit_and_stays_frozen():
    from lisaft.config.schema import LisaSection, OptimizerSection
    from lisaft.lisa import LisaController
    from lisaft.model.parts import model_parts
    from lisaft.model.units import model_units
    from lisaft.optim.unit_optimizers import UnitOptimizers

    for ends in (False, True):
        model, adapters, recipe = _adapted({"lora__train_embeddings": ends})
        parts = model_parts(model)
        units = adapters.trainable_units(model_units(parts))
        in_units = {id(p) for u in units for p in u.params}
        controller = LisaController(units, UnitOptimizers(units, OptimizerSection(), torch.device("cpu"),
                                                                  offload_dir="unused", seed=0),
                                    LisaSection(), seed=0)
        controller.activate_for_step(0)
        for name, p in model.named_parameters():
            trains = "lora_" in name or (ends and not name.startswith("model.layers."))
            assert p.requires_grad == trains and (id(p) in in_units) == trains, name
        assert [u.name for u in units][0] == ("embeddings" if ends else "layer-00000")


def test_the_estimate_counts_what_peft_and_bitsandbytes_build(tmp_path):
    """Adapters (DoRA's magnitudes included) exactly; the NF4 base within 1% of the tensors
    bitsandbytes keeps (packed weights, absmax, nested absmax, quantization maps)."""
    from transformers import AutoModelForCausalLM

    from lisaft.memory.counts import param_counts
    from lisaft.memory.estimate import compute
    from lisaft.memory.settings import Settings
    from lisaft.model.lora import attach_adapters, quantization_config

    model = tiny()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "base")
    recipe = _recipe(model__name_or_path=str(tmp_path / "base"), model__quantize="nf4", lora__dora=True)
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantization_config(
        recipe.model), device_map={"": "cpu"}, dtype=torch.bfloat16)
    attach_adapters(quantized, recipe)
    trainable = sum(p.numel() for p in quantized.parameters() if p.requires_grad)
    tensors = list(quantized.parameters()) + list(quantized.buffers())
    for p in quantized.parameters():
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            tensors += [qs.absmax, qs.code, qs.offset, qs.state2.absmax, qs.state2.code]
    held = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())
    s = Settings(recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_seq_len": 16})}),
                 model.config, "tiny", device="cpu")
    assert recipe.optimizer.name == "adamw_32bit" and recipe.lora.rank == 8
    est = compute(s, param_counts(model.config))
    assert est.trainable_params == trainable
    assert est.optimizer_state_bytes == 8 * trainable and est.grad_bytes == 2 * trainable
    assert abs(est.weights_bytes - held) <= 0.01 * held, (est.weights_bytes, held)
    plain = compute(s.with_keys({"lora.enabled": False, "model.quantize": None}), param_counts(model.config))
    assert est.weights_bytes < plain.weights_bytes


def test_cpu_eval_keeps_the_4bit_layout(tmp_path):
    from lisaft.config.schema import ModelSection
    from lisaft.model.load import load_model

    tiny().to(torch.bfloat16).save_pretrained(tmp_path / "base")
    section = ModelSection(name_or_path=str(tmp_path / "base"), quantize="nf4")
    model = load_model(section, torch.device("cpu"))
    proj = model.model.layers[0].self_attn.q_proj
    before = proj.weight.data.clone()
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert not proj.support_avx512bf16_for_cpu
    assert torch.equal(proj.weight.data, before)
    assert not getattr(proj.weight.quant_state, "packing_format_for_cpu", False)


def test_missing_peft_names_the_extra(monkeypatch):
    import sys

    from lisaft.model.lora import require_peft

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(LisaftError, match=r"pip install 'lisaft\[lora\]'"):
        require_peft()


def test_the_8b_lora_recipe_fits_and_lists_the_methods_in_learning_order():
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from lisaft.cli import app

    recipe = Path(__file__).parents[2] / "recipes" / "llama3.1-8b-lora-24gb.yaml"
    result = CliRunner().invoke(app, ["estimate-memory", str(recipe), "--budget", "24GiB", "--host-ram", "64GiB",
                                      "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["fits"] and out["settings"]["lora"]["rank"] == 8 and out["trainable_params"] == 20_971_520
    names = [m["method"] for m in out["methods"]]
    apollo = "APOLLO-Mini, every weight, step in backward"
    # What docs/learning.md measured, best first: every weight, then APOLLO's projection, LoRA, LISA.
    assert names == ["full fine-tuning, optimizer on the CPU", "full fine-tuning, paged 8-bit, step in backward",
                     apollo, "LoRA r8 (bf16 base)", "DoRA r8 (bf16 base)", "QLoRA r8 (4-bit base)", "LISA γ=2"]
    fitting = {m["method"] for m in out["methods"] if m["fits"]}
    assert fitting == {"LoRA r8 (bf16 base)", "DoRA r8 (bf16 base)", "QLoRA r8 (4-bit base)", apollo,
                       "full fine-tuning, optimizer on the CPU"}
    learned = {m["method"]: m["learned"] for m in out["methods"]}
    assert "70.1%" in learned["LoRA r8 (bf16 base)"] and "78.1%" in learned[apollo]
    assert all("docs/learning.md" in learned[n] or "not measured" in learned[n] for n in names)
    apollo_keys = next(m["set"] for m in out["methods"] if m["method"] == apollo)
    assert apollo_keys["optimizer.name"] == "apollo_mini" and apollo_keys["optimizer.in_backward"]
    assert "lora" in out["optimizers"]["adamw_32bit"]  # the run's adapters beside full and LISA


def test_a_method_the_gpu_holds_but_the_host_ram_does_not_says_so():
    import io

    from rich.console import Console

    from lisaft.memory.methods import methods
    from lisaft.memory.render import methods_table
    from lisaft.memory.settings import settings_for_config

    ways = methods(settings_for_config(tiny().config, device="cuda", budget_bytes=24 << 30, host_budget_bytes=1 << 10))
    offload = next(m for m in ways if m.name == "full fine-tuning, optimizer on the CPU")
    assert not offload.estimate.fits and offload.estimate.total_bytes <= offload.estimate.budget_bytes
    buf = io.StringIO()
    Console(file=buf, width=250).print(methods_table(ways, 24 << 30))
    row = next(line for line in buf.getvalue().splitlines() if "optimizer on the CPU" in line)
    assert "no: needs" in row and "of host RAM (--host-ram)" in row, row
    assert all("fits" in line for line in buf.getvalue().splitlines() if "LoRA r8" in line)
