"""The estimate of optimizer.cpu_offload: the GPU without moments or a gradient set, the host
components, the machine's RAM as a second budget, the advice, and the host figures against what
the offloaded optimizers hold on a tiny model."""

import json

import torch
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.memory.advice import advice
from lisaft.memory.catalogue import resolve_model
from lisaft.memory.counts import param_counts
from lisaft.memory.estimate import GiB, compute
from lisaft.memory.host import offload_host_bytes
from lisaft.memory.optimizer_state import state_bytes
from lisaft.memory.settings import Settings, settings_for_config

OFFLOAD = {"optimizer.cpu_offload": True}


def _8b(keys: dict | None = None, **machine) -> Settings:
    config, label = resolve_model("llama-3.1-8b")
    base = {"model.attention": "flash_attention_2", "model.gradient_checkpointing": True,
            "optimizer.name": "paged_adamw_8bit", "data.max_seq_len": 2048}
    return settings_for_config(config, {**base, **(keys or {})}, label, **{"host_budget_bytes": 64 * GiB, **machine})


def test_offload_leaves_no_moments_and_no_gradient_set_on_the_gpu():
    on, off = compute(_8b(OFFLOAD)), compute(_8b())
    counts = param_counts(_8b().config)
    largest = max(n for layer in counts.layers for n in layer) if not counts.embeddings else max(
        [*counts.embeddings, *counts.head, *(n for layer in counts.layers for n in layer)])
    assert on.components["optimizer_states"] == 0 and on.paged_state_bytes == 0
    assert "optimizer_step" not in on.phases
    # In flight: the gradient being copied out and the next one being produced.
    assert on.sizes["gradients"] == 2 * largest * 2
    assert on.total_bytes < 22 * GiB < off.total_bytes
    assert on.fits and sum(on.components.values()) == on.total_bytes


def test_host_components_are_the_formulas():
    e = compute(_8b(OFFLOAD))
    counts = param_counts(e.settings.config)
    host = e.host_components
    off = compute(_8b())
    assert host["moments"] == off.optimizer_state_bytes  # the same state, unpaged
    # Slabs of 1 GiB (the power of two that holds the 1.05 GB embedding): a tail is lost per slab.
    assert counts.total * 2 <= host["host_weights"] <= counts.total * 2 + 2 * GiB
    assert host["host_weights"] % GiB == 0
    # The device path's gradient set: the embedding's sparse rows, the rest dense, in slabs.
    assert off.grad_bytes <= host["gradient_accumulators"] <= off.grad_bytes + 2 * GiB
    assert host["staging"] == 4 * 256 * 2**20
    assert e.host_bytes == sum(host.values())
    assert 40 * GiB < e.host_bytes < 52 * GiB


def test_host_moments_by_moment_type():
    """8B full fine-tuning on a 64 GiB host: float32 moments do not fit, bfloat16 and 8-bit do."""
    runs = {m: compute(_8b({**OFFLOAD, "optimizer.name": o, "optimizer.moments_dtype": d}))
            for m, (o, d) in {"fp32": ("adamw_32bit", "float32"), "bf16": ("adamw_32bit", "bfloat16"),
                              "8bit": ("adamw_8bit", "float32")}.items()}
    counts = param_counts(runs["fp32"].settings.config)
    moments = {m: e.host_components["moments"] for m, e in runs.items()}
    assert moments["fp32"] == 8 * counts.total and moments["bf16"] == 4 * counts.total
    assert 2 * counts.total < moments["8bit"] < 2.1 * counts.total
    assert [runs[m].fits_host for m in ("fp32", "bf16", "8bit")] == [False, True, True]
    assert len({e.total_bytes for e in runs.values()}) == 1  # the GPU side holds no moments


def test_the_machines_ram_is_a_second_budget():
    small = compute(_8b(OFFLOAD, host_budget_bytes=32 * GiB))
    assert small.total_bytes <= small.budget_bytes and not small.fits_host and not small.fits
    assert compute(_8b(OFFLOAD, host_budget_bytes=None)).fits  # RAM unknown: not judged


def test_advice_proposes_cpu_offload_with_the_ram_it_needs():
    est = compute(_8b())
    assert not est.fits
    changes = advice(est, 32)
    offload = next(c for c in changes if c.overrides.get("optimizer.cpu_offload"))
    assert offload.estimate.fits
    assert f"{offload.estimate.host_bytes / GiB:.1f} GiB of RAM" in offload.why


def test_host_estimate_matches_what_the_offloaded_optimizers_hold(tmp_path):
    """Moments, weight copies and accumulators, estimated from parameter counts, against the
    bytes an offloaded run of a tiny model holds after a step (staging is CUDA only)."""
    from _tiny import tiny

    from lisaft.config.schema import OptimizerSection
    from lisaft.model.parts import model_parts
    from lisaft.model.units import model_units
    from lisaft.optim.cpu_offload import OffloadedOptimizers

    model = tiny(0, 2).to(torch.bfloat16)
    units = model_units(model_parts(model))
    opts = OffloadedOptimizers(units, OptimizerSection(name="adamw_8bit", cpu_offload=True), torch.device("cpu"),
                               tmp_path, seed=0)
    for u in units:
        opts.activate(u)
    x = torch.randint(0, 128, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    held = opts.host_bytes()
    opts.step(units)
    numels = [p.numel() for p in model.parameters()]
    numels = [h.numel() for u in opts.units.values() for h in u.params]  # the units' order
    est = offload_host_bytes("adamw_8bit", numels, numels, numels, 2, "stochastic", 0, 0)
    assert est["host_weights"] == held["host_weights"]
    assert est["gradient_accumulators"] == held["grad_accumulators"]
    assert est["moments"] == opts.state_bytes()[1]  # code books included on both sides
    assert est["moments"] == state_bytes("adamw_8bit", numels, 2, "cpu").total


def test_cli_flags_and_refusal():
    runner = CliRunner()
    out = runner.invoke(app, ["estimate-memory", "--model", "llama-3.1-8b", "--no-lisa", "--cpu-offload",
                              "--optimizer", "adamw_8bit", "--host-ram", "64GiB", "--gradient-checkpointing",
                              "--seq-len", "2048", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["settings"]["cpu_offload"] and data["host_budget_bytes"] == 64 * GiB
    assert data["host_bytes"] == sum(data["host_components"].values()) and data["fits_host"]
    bad = runner.invoke(app, ["estimate-memory", "--model", "llama-3.1-8b", "--cpu-offload", "--in-backward"])
    assert bad.exit_code != 0 and "--cpu-offload" in bad.output and "Traceback" not in bad.output


def test_the_full_recipes_header_states_the_estimate():
    import re
    from pathlib import Path

    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import settings_from_recipe

    path = Path(__file__).parents[2] / "recipes" / "llama3.1-8b-full-24gb.yaml"
    recipe = load_recipe(path)
    e = compute(settings_from_recipe(recipe).with_(host_budget_bytes=64 * GiB))
    header = path.read_text()
    assert f"GPU {e.total_bytes / GiB:.2f} GiB of 24.00 GiB" in header
    assert f"host {e.host_bytes / GiB:.2f} GiB" in header
    assert re.search(rf"needs about {round(e.host_bytes / GiB)} GiB of RAM", header) and e.fits


def test_lisa_offload_cpu_keeps_every_layers_moments_on_the_host():
    lisa = {"lisa.enabled": True, "lisa.active_layers": 2, **OFFLOAD}
    discard = compute(_8b({**lisa, "lisa.state_policy": "discard"}))
    kept = compute(_8b({**lisa, "lisa.state_policy": "offload_cpu"}))
    assert kept.host_components["moments"] == compute(_8b(OFFLOAD)).host_components["moments"]
    assert discard.host_components["moments"] < kept.host_components["moments"] / 5
    # Accumulators for the trained units only; the GPU side does not change with the policy.
    assert discard.host_components["gradient_accumulators"] < kept.host_components["host_weights"] / 4
    assert discard.total_bytes == kept.total_bytes
