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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_major_is_the_resident_run_bit_for_bit(tiny_run, dtype):
    resident = _run(tiny_run, "resident", _full(dtype, 8))
    device = _run(tiny_run, "device", _full(dtype, 8, cpu_offload=True))  # null resolves to device
    assert_same_run(resident, device)
    ref, lm = _train_records(resident), _train_records(device)
    assert [r["grad_norm"] for r in ref] == [r["grad_norm"] for r in lm]
    assert all(r["host_grad_additions"] == 0 for r in lm)



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
