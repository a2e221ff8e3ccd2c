"""optimizer.offload_accumulation: device (lisaft/train/layer_major.py) on CPU: the layer-major
backward is the resident run (no cpu_offload) bit for bit, each layer's gradient summed on the
device and shipped once; its counted transfers; a kill inside it resumes exactly."""

import pytest
from test_resume import assert_same_run

from lisaft.metrics.log import read_metrics
from lisaft.train import train


def _train_records(run):
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _full(dtype: str, accum: int, **optimizer) -> dict:
    return dict(model={"dtype": dtype}, lisa={"enabled": False},
                optimizer={"name": "adamw_32bit", "lr": 1e-3, **optimizer},
                training={"max_steps": 3, "grad_accum_steps": accum, "batch_size": 2, "eval_every": 3})


def _run(tiny_run, tag: str, sections: dict):
    assert train(tiny_run(f"{tag}.yaml", **sections), overrides=[f"training.output_dir={tag}"], show=False) == 0
    return tiny_run.dir / tag


@pytest.mark.parametrize("dtype, case", [("float32", None), ("bfloat16", None), ("float32", "packed"),
                                         ("bfloat16", "as_ready"), ("float32", "dropout")],
                         ids=["fp32", "bf16", "fp32-packed-checkpointed-chunked", "bf16-units-step-as-shipped",
                              "fp32-attention-dropout"])
def test_layer_major_is_the_resident_run_bit_for_bit(tiny_run, monkeypatch, dtype, case):
    """packed: rows of several documents (position ids restart: the recompute must get the
    forward's position embeddings and mask), gradient checkpointing in both runs, and the head's
    loss over chunks of positions. as_ready: no clipping, so each unit's CPU step starts as its
    summed gradient is shipped, while the layers below are still back-propagated. dropout: the
    recompute draws the forward's masks again (attention dropout 0.1)."""
    common = _full(dtype, 8)
    if case == "dropout":
        import json

        config = tiny_run.dir / "model" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "attention_dropout": 0.1}))
    if case == "as_ready":
        common["training"]["max_grad_norm"] = None
    if case == "packed":
        from lisaft.model import loss

        monkeypatch.setattr(loss, "LOSS_CHUNK_ELEMENTS", 64)
        common["model"]["gradient_checkpointing"] = True
        common["data"] = {"packing": True}
    resident = _run(tiny_run, "resident", common)
    device = _run(tiny_run, "device", {**common, "optimizer": {**common["optimizer"], "cpu_offload": True}})
    assert_same_run(resident, device)
    ref, lm = _train_records(resident), _train_records(device)
    assert [r["grad_norm"] for r in ref] == [r["grad_norm"] for r in lm]
    assert all(r["host_grad_additions"] == 0 for r in lm)



def test_a_tied_head_sums_both_uses_of_the_embedding(tiny_run):
    """A head tied to the input embedding: its gradient from the head (summed first, at the top)
    and from the lookup (summed last) are the resident run's sum in another order: the same run
    up to float32 rounding."""
    import json

    import torch
    from test_resume import final_weights, losses

    config = tiny_run.dir / "model" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tie_word_embeddings": True}))
    resident = _run(tiny_run, "resident", _full("float32", 4))
    device = _run(tiny_run, "device", _full("float32", 4, cpu_offload=True))
    assert torch.allclose(torch.tensor(list(losses(resident).values())), torch.tensor(list(losses(device).values())),
                          rtol=1e-5, atol=0)
    a, b = final_weights(resident), final_weights(device)
    assert a.keys() == b.keys() and "lm_head.weight" not in a
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_counted_transfers_device_and_host(tiny_run):
    """Dense gradients (no sparse embedding): `host` ships every micro-batch's gradient and adds
    all but the first on the host; `device` in one group ships one gradient and the saved layer
    inputs (fetched back as many bytes), and adds nothing; in groups of 2, one addition each."""
    accum, dense = 4, {"sparse_embedding_grad": False}
    runs = {tag: _train_records(_run(tiny_run, tag, {**_full("float32", accum, cpu_offload=True, **extra),
                                                     "model": {"dtype": "float32", **dense}}))
            for tag, extra in (("host", {"offload_accumulation": "host"}), ("device", {}),
                               ("grouped", {"offload_group_size": 2}))}
    for host, device, grouped in zip(runs["host"], runs["device"], runs["grouped"]):
        weights = host["offload_h2d_bytes"]  # every weight stepped and sent back once
        elements = weights // 4
        assert host["offload_d2h_bytes"] == accum * weights
        assert host["host_grad_additions"] == (accum - 1) * elements
        assert device["host_grad_additions"] == 0
        saved = device["offload_d2h_bytes"] - weights
        layers, hidden = 4, 32
        assert saved > 0 and saved % (layers * hidden * 4) == 0
        assert device["offload_h2d_bytes"] == weights + saved
        assert grouped["host_grad_additions"] == elements
        assert grouped["offload_d2h_bytes"] == 2 * weights + saved


# A training process that stops, forever, inside the layer-major backward of step 3 (its second
# layer from the top), once its checkpoint of step 2 is written: the test kills it there.
PAUSED_IN_BACKWARD = """
import pathlib, sys, time
from lisaft.train import layer_major
calls, original = [], layer_major.LayerMajor._layer_backward
def paused(self, index, grads):
    calls.append(index)
    if len(calls) == 4 * 2 + 2:
        pathlib.Path(sys.argv[2]).write_text("paused")
        time.sleep(600)
    return original(self, index, grads)
layer_major.LayerMajor._layer_backward = paused
from lisaft.cli import app
app(["train", sys.argv[1]])
"""


@pytest.mark.slow  # the killed run is a process of its own: an interpreter that imports torch
def test_sigkill_in_the_layer_major_backward_resumes_exactly(tiny_run):
    import os
    import signal
    import subprocess
    import sys
    import time

    from lisaft.train.commands import resume

    common = {**_full("bfloat16", 4, cpu_offload=True), "training": {
        "max_steps": 4, "grad_accum_steps": 4, "batch_size": 2, "eval_every": 2, "save_every": 2}}
    ref = _run(tiny_run, "ref", common)
    recipe = tiny_run("killed.yaml", **{**common, "training": {**common["training"], "output_dir": "killed"}})
    mark = tiny_run.dir / "paused"
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_IN_BACKWARD, str(recipe), str(mark)], cwd=tiny_run.dir,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while not mark.exists():
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = tiny_run.dir / "killed"
    assert max(r["step"] for r in _train_records(killed)) == 2
    assert resume(killed, show=False) == 0
    assert_same_run(ref, killed)
