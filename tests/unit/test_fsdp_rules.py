"""training.fsdp pieces that need no process group: refusals, per-slice rounding, the layer check."""

import pytest
import torch

from lisaft.config.compat import check_world
from lisaft.config.schema import Recipe, recipe_from_dict
from lisaft.distributed import dist, fsdp
from lisaft.errors import LisaftError
from lisaft.optim.rounding import Rounding

BASE = {
    "model": {"config": "cfg/config.json", "tokenizer": "tok"},
    "data": {"train": "data/train.jsonl", "format": "instruction"},
    "training": {"max_steps": 10, "output_dir": "runs/x", "fsdp": True},
}


def recipe(**sections) -> Recipe:
    data = {k: dict(v) for k, v in BASE.items()}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    return recipe_from_dict(data)


@pytest.mark.parametrize("sections, words", [
    ({"optimizer": {"name": "paged_adamw_8bit"}}, "optimizer.name paged_adamw_8bit"),
    ({"optimizer": {"in_backward": True}, "training": {"max_grad_norm": None}}, "optimizer.in_backward"),
    ({"optimizer": {"cpu_offload": True}}, "optimizer.cpu_offload"),
    ({"training": {"shard_optimizer_state": True}}, "training.shard_optimizer_state"),
    ({"training": {"compile": True}}, "training.compile"),
])
def test_what_fsdp_cannot_run_is_refused_by_the_recipe_in_one_line(sections, words):
    with pytest.raises(LisaftError) as e:
        recipe(**sections)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_fsdp_without_torchrun_is_refused_in_one_line():
    with pytest.raises(LisaftError, match="torchrun --nproc-per-node") as e:
        check_world(recipe(), world_size=1, launched=False, device="cpu")  # one process: nothing to shard over
    assert "\n" not in str(e.value)
    check_world(recipe(), world_size=1, launched=True, device="cpu")  # one rank under torchrun: allowed


def test_sharded_optimizer_state_without_torchrun_is_refused_like_fsdp_naming_the_resume_launch():
    data = {k: dict(v) for k, v in BASE.items()}
    data["training"].update(fsdp=False, shard_optimizer_state=True)
    with pytest.raises(LisaftError, match=r"training.shard_optimizer_state shards over torchrun's ranks") as e:
        check_world(recipe_from_dict(data), world_size=1, launched=False, device="cpu")
    assert "-m lisaft resume RUN`" in str(e.value) and "for a new run, set" in str(e.value)
    check_world(recipe_from_dict(data), world_size=1, launched=True, device="cpu")


@pytest.mark.parametrize("optimizer, words", [
    ({"in_backward": True}, "optimizer.in_backward cannot run data parallel"),
    ({"cpu_offload": True}, "optimizer.cpu_offload runs on one device"),
])
def test_what_data_parallel_cannot_run_is_refused_at_set_up(optimizer, words):
    data = {k: dict(v) for k, v in BASE.items()}
    data["training"].update(fsdp=False, max_grad_norm=None)
    data["optimizer"] = optimizer
    r = recipe_from_dict(data)
    check_world(r, world_size=1, launched=False, device="cpu")  # one process: fine
    with pytest.raises(LisaftError, match=words):
        check_world(r, world_size=2, launched=True, device="cpu")


def test_slices_of_different_ranks_round_with_different_noise_and_each_is_repeatable():
    src = torch.full((4096,), 1.0 + 2 ** -9, dtype=torch.float32)  # a quarter ulp above 1 in bf16

    def rounded(shard):
        r = Rounding("stochastic", seed=3, shard=shard)
        r.step = 7
        out = torch.empty(4096, dtype=torch.bfloat16)
        r.write(out, src.clone(), 1, 2, 0)
        return out

    assert rounded(0).equal(rounded(0)) and rounded(1).equal(rounded(1))
    assert not rounded(0).equal(rounded(1))
    # Without FSDP the key is what it was: data-parallel replicas and old runs see the same noise.
    assert rounded(None).equal(rounded(None)) and not rounded(None).equal(rounded(0))


def test_ranks_that_disagree_on_the_layers_fail_in_one_line(monkeypatch):
    monkeypatch.setattr(dist, "world_size", lambda: 2)

    def gather(out, mine):
        out[0], out[1] = mine, [mine[0], 0, 3]

    monkeypatch.setattr(fsdp.torch_dist, "all_gather_object", gather)
    shards = fsdp.LocalShards(torch.nn.Linear(2, 2))
    shards.check_same_layers(5, [0, 3])  # what the other rank sampled: fine
    with pytest.raises(LisaftError) as e:
        shards.check_same_layers(5, [1, 2])
    assert "ranks disagree on LISA's layers for interval 5" in str(e.value) and "\n" not in str(e.value)
