"""LoRA under data parallel: two gloo processes on CPU take the update one process takes at twice
the batch (the adapters are ordinary units, their gradients summed over ranks), and a two-rank
LoRA run checkpoints and resumes bit for bit."""

import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import COMMON, assert_same_grad_norms, torchrun, train_losses

from lisaft.train import train

pytest.importorskip("peft")
LORA = {"enabled": True, "rank": 4}


def recipe(tiny_run, name: str, **training):
    return tiny_run(f"{name}.yaml", **{**COMMON, "lisa": {"enabled": False}, "lora": LORA,
                                       "optimizer": {"name": "adamw_32bit", "lr": 1e-2},
                                       "training": {**COMMON["training"], "output_dir": name, "save_every": 2,
                                                    "eval_every": 0, **training}})


def adapters(run, step=4):
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "adapters" / "adapter_weights.safetensors"))


def test_two_rank_lora_matches_one_process_and_resumes_bit_for_bit(tiny_run):
    two = recipe(tiny_run, "dp", batch_size=2)
    result = torchrun("train", str(two), cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert train(recipe(tiny_run, "single", batch_size=4), show=False) == 0
    dp, single = tiny_run.dir / "dp", tiny_run.dir / "single"
    # Float tolerance, not bit equality: the all-reduced gradient sums in another order
    # (test_distributed.py); the data, the adapters' init and the learning rate are identical.
    a, b = train_losses(single), train_losses(dp)
    assert len(a) == len(b) == 4
    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=0), (a, b)
    assert_same_grad_norms(dp, single, rtol=1e-5)
    wa, wb = adapters(single), adapters(dp)
    assert wa.keys() == wb.keys() and all("lora_" in k for k in wa)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), k
    assert any(not wb[k].equal(w) for k, w in adapters(dp, 2).items())  # the adapters moved

    # The step-2 checkpoint resumed on two ranks is the uninterrupted two-rank run, bit for bit.
    cut = tiny_run.dir / "cut"
    shutil.copytree(dp, cut)
    shutil.rmtree(cut / "final")
    shutil.rmtree(cut / "checkpoints" / "step-000004")
    result = torchrun("resume", str(cut), cwd=tiny_run.dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert train_losses(cut) == b
    wc = adapters(cut)
    assert all(wc[k].equal(wb[k]) for k in wb)
    final_dp, final_cut = load_file(str(dp / "final" / "model.safetensors")), load_file(
        str(cut / "final" / "model.safetensors"))
    assert all(final_cut[k].equal(final_dp[k]) for k in final_dp)
