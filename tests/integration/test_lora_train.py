"""LoRA, DoRA and QLoRA through `lisaft train`: they learn, resume bit for bit, checkpoint only the
adapters, export merged (base + scaled B A) or in peft's format, generate, and refuse another base."""

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.metrics.log import read_metrics

pytest.importorskip("peft")
runner = CliRunner()
NO_LISA = {"enabled": False}


def _losses(run):
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _base(tiny_run, dtype=torch.bfloat16):
    """The tiny run's architecture saved with weights: a base to put adapters on."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tiny_run.dir / "base"
    if not folder.is_dir():
        # hidden 64: bitsandbytes' CPU kernel repacks 4-bit weights by blocks of 64 inputs.
        config = AutoConfig.from_pretrained(tiny_run.dir / "model", hidden_size=64, intermediate_size=128,
                                            head_dim=16)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(folder)
    return folder


def _recipe(tiny_run, name="recipe.yaml", quantize=None, lora=None, model=None, **sections):
    model = {"name_or_path": str(_base(tiny_run)), "config": None, "dtype": "bfloat16", "quantize": quantize,
             **(model or {})}
    sections["optimizer"] = {"name": "adamw_32bit", "lr": 1e-2, **sections.get("optimizer", {})}
    return tiny_run(name, model=model, lisa=NO_LISA, lora={"enabled": True, "rank": 4, **(lora or {})}, **sections)


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_lora_learns_and_resumes_bit_for_bit_with_only_adapters_checkpointed(tiny_run, quantize):
    from lisaft.train import train
    from lisaft.train.commands import resume

    common = {"training": {"max_steps": 6, "eval_every": 0, "save_every": 3}}
    ref = _recipe(tiny_run, "ref.yaml", quantize, **common)
    assert train(ref, overrides=["training.output_dir=ref"], show=False) == 0
    losses = _losses(tiny_run.dir / "ref")
    assert sum(losses[-2:]) < sum(losses[:2]), losses  # it learns
    ckpt = tiny_run.dir / "ref" / "checkpoints" / "step-000006"
    assert not (ckpt / "weights").exists()
    saved = load_file(str(ckpt / "adapters" / "adapter_weights.safetensors"))
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:4]
    assert train(ref, overrides=["training.output_dir=cut"], show=False, _stop_at=4) != 0
    assert resume(tiny_run.dir / "cut", show=False) == 0
    assert _losses(tiny_run.dir / "cut") == losses
    again = load_file(str(tiny_run.dir / "cut" / "checkpoints" / "step-000006" / "adapters" /
                          "adapter_weights.safetensors"))
    assert all(saved[k].equal(again[k]) for k in saved)
    _check_merged(tiny_run.dir / "ref", saved, quantize)


def _check_merged(run, adapters, quantize):
    """final/ is a plain transformers model: each adapted weight is base + (alpha/r) B A, in bf16."""
    from transformers import AutoModelForCausalLM

    base = load_file(str(run.parent / "base" / "model.safetensors"))
    merged = AutoModelForCausalLM.from_pretrained(run / "final")
    assert not hasattr(merged.config, "quantization_config")
    state = merged.state_dict()
    name = "model.layers.1.mlp.down_proj"
    a = adapters[f"{name}.lora_A.default.weight"].float()
    b = adapters[f"{name}.lora_B.default.weight"].float()
    want = base[f"{name}.weight"].float() + (8 / 4) * b @ a  # alpha default 2 x rank
    got = state[f"{name}.weight"].float()
    assert got.dtype == torch.float32 and state[f"{name}.weight"].dtype == torch.bfloat16
    # bf16 rounding of the sum; NF4's own rounding of the base (blocks of 64, 16 levels) for QLoRA
    tol = 0.01 * want.abs().max() if quantize is None else 0.25 * base[f"{name}.weight"].float().abs().max()
    assert (got - want).abs().max() <= tol
    assert not (b @ a).abs().max() == 0  # the adapters moved
    assert state["model.layers.0.input_layernorm.weight"].equal(base["model.layers.0.input_layernorm.weight"])


def _generate(*args):
    return runner.invoke(app, ["generate", *map(str, args), "--prompt", "abc", "--max-new-tokens", "3", "--json"])


def test_dora_adapter_export_loads_with_peft_and_generates_as_its_checkpoint(tiny_run):
    """lora.export: adapter writes peft's folder; peft puts it on the base with the logits of the
    run's own model (its last checkpoint, built as training built it); an 8-bit optimizer, packing,
    gradient checkpointing and the step in backward train the adapters unchanged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lisaft.generate.target import load_model, resolve_target
    from lisaft.train import train

    recipe = _recipe(tiny_run, lora={"dora": True, "export": "adapter"}, data={"packing": True, "max_seq_len": 64},
                     model={"gradient_checkpointing": True},
                     optimizer={"name": "paged_adamw_8bit", "lr": 1e-2, "in_backward": True},
                     training={"max_steps": 3, "eval_every": 0, "save_every": 3, "max_grad_norm": None})
    assert train(recipe, show=False) == 0
    run = tiny_run.dir / "run"
    cfg = json.loads((run / "final" / "adapter_config.json").read_text())
    assert cfg["use_dora"] and cfg["base_model_name_or_path"] == str(tiny_run.dir / "base")
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    base = AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"], dtype="auto")
    peft_model = PeftModel.from_pretrained(base, str(run / "final"), autocast_adapter_dtype=False).eval()
    ours = load_model(resolve_target(run / "checkpoints" / "step-000003", None))
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, ours(input_ids=ids).logits)
    final, ckpt = _generate(run), _generate(run / "checkpoints" / "step-000003")
    assert final.exit_code == 0 and ckpt.exit_code == 0, final.output + ckpt.output
    assert json.loads(final.output.splitlines()[-1]) == json.loads(ckpt.output.splitlines()[-1])


def test_a_resume_against_another_base_is_refused_in_one_line(tiny_run):
    from transformers import AutoModelForCausalLM

    from lisaft.train import train

    recipe = _recipe(tiny_run, training={"max_steps": 4, "eval_every": 0, "save_every": 2})
    assert train(recipe, show=False, _stop_at=2) != 0
    base = tiny_run.dir / "base"
    other = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(2)
    other.save_pretrained(base)
    result = runner.invoke(app, ["resume", str(tiny_run.dir / "run")])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "fingerprint" in lines[0] and "trained on base" in lines[0], lines


def test_a_lora_run_says_it_trains_adapters_and_every_layer(tiny_run):
    recipe = _recipe(tiny_run, model={"gradient_checkpointing": True}, training={"max_steps": 2, "eval_every": 0})
    result = runner.invoke(app, ["train", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "LoRA rank 4 on a frozen base, adamw_32bit" in result.output and "full fine-tuning" not in result.output
    steps = [line for line in result.output.splitlines() if line.startswith("step ")]
    assert steps and all("  layers all" in line for line in steps), result.output
    # transformers' deprecation of is_gradient_checkpointing is advisory: hidden (docs/logging.md).
    assert "is_gradient_checkpointing" not in result.output and "warning" not in result.output, result.output
