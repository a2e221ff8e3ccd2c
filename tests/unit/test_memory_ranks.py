"""The estimator under training.fsdp: per-rank slices, FSDP's transient terms, --ranks."""

import json

import pytest
from typer.testing import CliRunner

from lisaft.cli import app
from lisaft.memory.advice import fewest_ranks
from lisaft.memory.catalogue import resolve_model
from lisaft.memory.counts import param_counts
from lisaft.memory.estimate import GiB, compute
from lisaft.memory.settings import Settings, settings_for_config

FSDP_ONLY = ("gathered_units", "gradient_reduce", "unsharded_load")


FSDP = {"training.fsdp": True}
LISA = {"lisa.enabled": True}
# A random init from model.config, rather than weights read from model.name_or_path.
FROM_CONFIG = {"model.name_or_path": None, "model.config": "config.json", "model.tokenizer": "tokenizer"}


def settings(model="llama-3.1-8b", keys: dict | None = None, **machine) -> Settings:
    config, label = resolve_model(model)
    base = {"optimizer.name": "adamw_8bit", "model.gradient_checkpointing": True,
            "model.attention": "flash_attention_2", "data.max_seq_len": 2048, "model.sparse_embedding_grad": False}
    return settings_for_config(config, {**base, **(keys or {})}, label, **machine)


def buffers(est) -> int:
    c = param_counts(est.settings.config)
    return c.buffer_bytes_fp32 + (c.buffer_numel * 4 - c.buffer_bytes_fp32) * 2 // 4


@pytest.mark.parametrize("lisa", [False, True])
def test_slices_divide_by_the_ranks_and_activations_do_not(lisa):
    # Every first dimension of Llama-3.1-8B divides by 8: the slices are exact fractions.
    keys = {**FSDP, "lisa.enabled": lisa}
    one = compute(settings(keys=keys, ranks=1))
    for n in (2, 4, 8):
        est = compute(settings(keys=keys, ranks=n))
        assert (est.weights_bytes - buffers(est)) * n == one.weights_bytes - buffers(one)
        assert est.grad_bytes * n == one.grad_bytes
        # 8-bit moments: per-slice absmax blocks and the shared maps keep it within 0.1% of 1/n.
        assert est.optimizer_state_bytes * n == pytest.approx(one.optimizer_state_bytes, rel=1e-3)
        assert est.sizes["activations"] == one.sizes["activations"]
        assert est.saved_activation_bytes == one.saved_activation_bytes
        assert est.sizes["logits_loss"] == one.sizes["logits_loss"]
        # Gathered units are whole weights whatever the number of ranks.
        assert est.sizes["gathered_units"] == one.sizes["gathered_units"]
        # A model built from model.config is whole on each rank before it is sharded; weights from
        # model.name_or_path are read shard by shard (lisaft/distributed/fsdp.py load_sharded), never whole.
        built = compute(settings(keys={**keys, **FROM_CONFIG}, ranks=n))
        assert est.weights_bytes + built.sizes["unsharded_load"] == one.weights_bytes
        assert est.sizes["unsharded_load"] == 0 and "model_load" not in est.phases
        assert "model_load" in built.phases
        assert est.trainable_params == one.trainable_params


def test_one_rank_holds_what_one_process_holds():
    for lisa in (False, True):
        plain = compute(settings(keys={"lisa.enabled": lisa}))
        fsdp = compute(settings(keys={"lisa.enabled": lisa, **FSDP}, ranks=1))
        for key in ("weights", "gradients", "optimizer_states", "activations", "logits_loss"):
            assert fsdp.sizes[key] == plain.sizes[key], key
        assert not set(FSDP_ONLY) & set(plain.components)
        # ... plus FSDP's gathered copies and reduce-scatter buffers, which one process does not have.
        assert fsdp.total_bytes > plain.total_bytes


def test_slices_are_padded_as_torch_pads_dim_0():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=65, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    counts = param_counts(cfg)
    sharded, gathered = counts.sharded(2), counts.gathered(2)
    assert sharded.embeddings == (33 * 32,) and gathered.embeddings == (66 * 32,)  # ceil(65 / 2) rows
    assert sharded.head == (33 * 32, 16) and counts.head == (65 * 32, 32)  # lm_head, then the final norm
    assert sharded.layers[0] == tuple(n // 2 for n in counts.layers[0])  # 32, 64 and 16 rows split evenly


def test_frozen_units_are_gathered_but_reduce_nothing():
    full = compute(settings(keys=FSDP, ranks=4))
    frozen = compute(settings(keys={**FSDP, **LISA, "lisa.train_embeddings": False, "lisa.train_head": False},
                              ranks=4))
    loss = {k: v for k, v in zip(("gathered", "reduce"), _at(frozen, "loss_backward"))}
    assert loss["reduce"] == 0  # a frozen head: no gradient, no reduce-scatter
    assert loss["gathered"] == _at(full, "loss_backward")[0]  # ... but still gathered
    assert "root_backward" not in frozen.phases and "root_backward" in full.phases


def _at(est, phase):
    """(gathered_units, gradient_reduce) of the estimate at `phase`, computed again for that phase."""
    from lisaft.memory.sharded import fsdp_phases, fsdp_units

    s = est.settings
    return fsdp_phases(fsdp_units(param_counts(s.config), s), 2, s.ranks)[phase]


def test_the_root_holds_the_whole_head_gradient_until_its_float32_reduce_scatter():
    est = compute(settings(keys=FSDP, ranks=4))
    counts = param_counts(est.settings.config)
    head, embeddings = sum(counts.head), sum(counts.embeddings)  # each divisible by 4
    # The head is in the root unit: the loss's backward makes its whole gradient (bf16, 2 B) and
    # keeps it; no reduce-scatter happens until the root's, after the embeddings' backward.
    assert _at(est, "loss_backward")[1] == head * 2
    gathered, reduce = _at(est, "root_backward")
    root = head + embeddings
    # Either the bf16 gradients of the whole root beside the last layer's float32 buffer, or the
    # root's float32 reduce-scatter input beside its bf16 gradient.
    layer = max(sum(layer) for layer in counts.layers)
    assert gathered + reduce == max(2 * root + 2 * root + 4 * layer, 4 * root + 2 * root)


def test_fewest_ranks_is_the_first_count_that_fits():
    s = settings("llama-3.1-70b", LISA, budget_bytes=140 * GiB)
    change = fewest_ranks(s, 80)
    assert change is not None and change.estimate.fits and change.overrides["training.fsdp"] is True
    fewer = change.ranks // 2
    assert fewer < 2 or not compute(s.with_keys(FSDP).with_(ranks=fewer)).fits
    # Paged state is refused under FSDP: the proposal names the unpaged optimizer it runs with.
    paged = fewest_ranks(s.with_keys({"optimizer.name": "paged_adamw_8bit"}), 80)
    assert paged.overrides["optimizer.name"] == "adamw_8bit"


def _cli(*args):
    return CliRunner().invoke(app, ["estimate-memory", "--model", "llama-3.2-1b", *args])


@pytest.mark.parametrize("args, words", [
    (["--fsdp", "--ranks", "0"], "--ranks: must be at least 1, got 0"),
    (["--ranks", "4"], "without training.fsdp every rank holds the whole model"),
    (["--fsdp"], "give --ranks N, the number of processes"),
    (["--fsdp", "--ranks", "2", "--optimizer", "paged_adamw_8bit"],
     "--optimizer paged_adamw_8bit --fsdp: invalid recipe: optimizer.name paged_adamw_8bit is not supported with "
     "training.fsdp (paging of one rank's slices is untested on CUDA); use adamw_8bit"),
    (["--fsdp", "--ranks", "2", "--cpu-offload"], "--cpu-offload --fsdp: invalid recipe: optimizer.cpu_offload runs on "
     "one device and cannot be combined with training.fsdp"),
])
def test_bad_ranks_are_refused_in_one_line(args, words):
    result = _cli(*args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.output


def test_ranks_one_without_fsdp_is_the_single_process_estimate():
    plain, one = json.loads(_cli("--json").stdout), json.loads(_cli("--json", "--ranks", "1").stdout)
    assert plain == one and plain["settings"]["fsdp"] is False and plain["settings"]["ranks"] == 1
    # FSDP on one rank (torchrun --nproc-per-node 1) holds the same slices, plus gathered copies.
    fsdp = json.loads(_cli("--json", "--fsdp", "--ranks", "1").stdout)
    assert fsdp["sizes"]["weights"] == plain["sizes"]["weights"] and fsdp["total_bytes"] > plain["total_bytes"]


def test_json_under_fsdp_keeps_every_field_and_adds_the_per_rank_ones():
    plain = json.loads(_cli("--json").stdout)
    result = _cli("--json", "--fsdp", "--ranks", "4")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(plain) <= set(out) and set(plain["settings"]) <= set(out["settings"])
    assert out["settings"]["fsdp"] is True and out["settings"]["ranks"] == 4
    assert set(FSDP_ONLY) <= set(out["components"]) and set(FSDP_ONLY) <= set(out["sizes"])
    assert sum(out["components"].values()) == out["total_bytes"]
    # --model: weights from files, read shard by shard, so no rank loads the whole model.
    assert "model_load" not in out["phases"] and out["fewest_ranks"] is None
    assert out["sizes"]["unsharded_load"] == 0 and out["settings"]["model_from_config"] is False
    assert all("ranks" in a for a in out["advice"])
    assert "paged_adamw_8bit" not in out["optimizers"]  # FSDP refuses it
    text = " ".join(_cli("--fsdp", "--ranks", "4").stdout.split())
    assert "training.fsdp, per rank of 4" in text and "gathered_units" in text


def test_auto_layers_under_fsdp_fit_one_rank_of_this_process_group(monkeypatch):
    """lisa.active_layers: auto picks γ from the per-rank estimate: more ranks, more layers."""
    from pathlib import Path

    from lisaft.config.schema import load_recipe
    from lisaft.memory.auto_layers import resolve_active_layers

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
    chosen = {}
    for world in (2, 8):
        monkeypatch.setenv("WORLD_SIZE", str(world))  # what torchrun sets; dist reads it
        r = load_recipe(recipe, ["training.fsdp=true", "lisa.active_layers=auto", "optimizer.name=adamw_8bit"])
        chosen[world] = resolve_active_layers(r, "cuda", 20 * GiB).active_layers
    assert 1 <= chosen[2] < chosen[8]


def test_only_a_model_built_from_its_config_is_loaded_whole_on_each_rank(tmp_path):
    """model.config (random init) is built whole and then sharded; model.name_or_path is not."""
    from pathlib import Path

    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import settings_from_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
    config, _ = resolve_model("llama-3.1-8b")
    config.save_pretrained(tmp_path)
    common = ["training.fsdp=true", "optimizer.name=adamw_8bit"]
    loaded = settings_from_recipe(load_recipe(recipe, common), ranks=4)
    built = settings_from_recipe(load_recipe(recipe, [*common, "model.name_or_path=null",
                                                      f"model.config={tmp_path}", f"model.tokenizer={tmp_path}"]),
                                 ranks=4)
    assert loaded.recipe.model.config is None and built.recipe.model.config is not None
    est_loaded, est_built = compute(loaded), compute(built)
    assert "model_load" not in est_loaded.phases
    whole = est_built.total_params * 2  # bf16
    assert est_built.sizes["unsharded_load"] == whole - (est_loaded.weights_bytes - buffers(est_loaded))
