"""benchmarks/lisa_bench.py --quick: the LISA benchmark's code path, on a tiny model, so it cannot
rot; and the invariants that hold at any size."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LISAFT_RUNS = {"lisaft_full", "lisaft_lisa_discard", "lisaft_lisa_offload_cpu", "lisaft_lisa_offload_disk",
               "lisaft_lisa_keep", "lisaft_lisa_discard_frozen_emb"}
HF_RUNS = {"hf_full", "hf_lisa_lmflow"}


def test_lisa_bench_quick(tmp_path):
    out = tmp_path / "lisa_bench.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lisa_bench", "--quick", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    s = summary["settings"]
    assert summary["mode"] == "quick" and s["active_layers"] == 2
    n_intervals = s["steps"] // s["interval"]
    assert n_intervals >= 2

    runs = {r["run"]: r for r in summary["runs"]}
    assert set(runs) == LISAFT_RUNS | HF_RUNS
    hf_available = importlib.util.find_spec("accelerate") is not None
    for name, r in runs.items():
        if name in HF_RUNS and not hf_available:
            assert r["status"] == "skipped" and "accelerate" in r["note"]
            continue
        assert r["status"] == "ok", name
        assert len(r["step_wall_s"]) == s["steps"]
        assert r["tokens_per_step"] == s["batch_size"] * s["seq_len"]
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_mean"] > 0, name
        assert [iv["interval"] for iv in r["intervals"]] == list(range(n_intervals)), name
    if not hf_available:
        assert any("accelerate" in n for n in summary["notes"])

    def states(name):
        return [iv["device_state_bytes"] for iv in runs[name]["intervals"]]

    full = summary["full_ft_state_bytes"]
    assert full == states("lisaft_full")[-1] > 0
    # discard and offload_*: the device holds the current trainable set's state, never more.
    for policy in ("discard", "offload_cpu", "offload_disk"):
        st = states(f"lisaft_lisa_{policy}")
        assert len(set(st)) == 1 and st[0] < full, (policy, st)
        assert summary["targets"][f"state_constant_{policy}"] is True
    assert all(iv["offloaded_state_bytes"] == 0 for iv in runs["lisaft_lisa_discard"]["intervals"])
    assert runs["lisaft_lisa_offload_cpu"]["intervals"][-1]["offloaded_state_bytes"] > 0
    assert runs["lisaft_lisa_offload_disk"]["intervals"][-1]["offloaded_state_bytes"] > 0
    # keep, like LMFlow: state of every layer ever sampled stays, so it grows.
    keep = states("lisaft_lisa_keep")
    assert keep[-1] > keep[0] and keep == sorted(keep)
    assert states("lisaft_lisa_discard_frozen_emb")[0] < states("lisaft_lisa_discard")[0]
    if hf_available:
        lmflow = states("hf_lisa_lmflow")
        assert lmflow[-1] > lmflow[0] and lmflow == sorted(lmflow)
        assert summary["targets"]["hf_lisa_lmflow_state_grows"] is True
        # Same init, same batches, same optimizer and clipping: the Trainer's full fine-tuning
        # holds exactly lisaft's optimizer state.
        assert states("hf_full")[-1] == full
        assert "speedup_discard_vs_hf_full" in summary["targets"]
    assert "| lisaft_lisa_discard |" in proc.stdout


def _bench_module():
    mod = importlib.import_module("benchmarks.lisa_bench")
    return mod


def test_flops_per_token_counts_what_lisa_skips():
    bench = _bench_module()
    cfg = {"num_hidden_layers": 4, "hidden_size": 8}
    counts = {"per_decoder_layer_matmul": 100, "head": 40}
    full = bench.flops_per_token(counts, cfg, 16, None)
    assert full == 4 * (6 * 100 + 3 * 4 * 16 * 8) + 6 * 40
    # LISA with every layer active is full fine-tuning; with γ = 2 it saves two layers' weight
    # gradients (2 FLOPs per parameter each), nothing else while the embeddings train.
    assert bench.flops_per_token(counts, cfg, 16, [[0, 1, 2, 3]]) == full
    assert bench.flops_per_token(counts, cfg, 16, [[1, 3]]) == full - 2 * 2 * 100
    # Frozen embeddings: nothing below the lowest active layer runs backward.
    assert bench.flops_per_token(counts, cfg, 16, [[1, 3]], train_embeddings=False) \
        < bench.flops_per_token(counts, cfg, 16, [[1, 3]])
    # Gradient checkpointing runs every layer's forward once more (each layer: 2 x 100 + 4 x 16 x 8).
    layer_fwd = 2 * 100 + 4 * 16 * 8
    assert bench.flops_per_token(counts, cfg, 16, None, recompute=True) == full + 4 * layer_fwd
    assert bench.flops_per_token(counts, cfg, 16, [[1, 3]], recompute=True) == full - 2 * 2 * 100 + 4 * layer_fwd
    # With frozen embeddings only the layers backward crosses (from the lowest active one) recompute.
    assert bench.flops_per_token(counts, cfg, 16, [[1, 3]], train_embeddings=False, recompute=True) \
        == bench.flops_per_token(counts, cfg, 16, [[1, 3]], train_embeddings=False) + 3 * layer_fwd


def test_whole_process_timing_runs_each_contender_at_n_and_2n_steps(tmp_path):
    # The benchmark's own process in this one (its whole-process runs are fresh ones, as ever):
    # one interpreter start fewer; it sets the torch thread count, given back after.
    import torch

    out, threads = tmp_path / "lisa_bench.json", torch.get_num_threads()
    try:
        assert _bench_module().main(["--quick", "--only", "lisaft_lisa_discard", "--processes", "1",
                                     "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    summary = json.loads(out.read_text())
    run = summary["runs"][0]
    n = summary["settings"]["steps"]
    assert run["whole_process"]["steps"] == [n, 2 * n]
    assert all(len(v) == 1 and v[0] > 0 for v in run["whole_process"]["wall_s"].values())
    assert 0 < run["share_of_flop_bound"] < 1 and summary["machine"]["matmul_flops_per_s"] > 0
