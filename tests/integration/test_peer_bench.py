"""benchmarks/peer_bench.py: its sides run on the quick shape (in this process: a fresh
interpreter per side costs seconds of imports each), and the driver alternates the sides and
reports the best round of each."""

import json

import pytest

from benchmarks import peer_bench
from benchmarks.peer_bench import compare, settings
from benchmarks.peer_sides import run_side


# slow: each side builds a model and its trainer (imports of transformers' Trainer, TRL and a
# first numba call) before its six steps; seconds each on two cores.
@pytest.mark.slow
@pytest.mark.parametrize("name,comparison", [("lisaft_lisa", "lisa"), ("hf_lmflow", "lisa")])
def test_a_side_stamps_every_step_after_the_warmup(tmp_path, name, comparison):
    pytest.importorskip("accelerate")
    s = settings(comparison, "quick", None, 1)
    r = run_side(name, s, tmp_path, profile=False)
    assert r["steps_timed"] == s["steps"] - s["warmup"]
    assert r["steps_per_s"] > 0 and r["step_s_median"] > 0


@pytest.mark.slow
def test_dpo_sides_run_the_same_pairs(tmp_path):
    pytest.importorskip("trl")
    s = settings("dpo", "quick", None, 1)
    for name in ("lisaft_dpo", "trl_dpo"):
        r = run_side(name, s, tmp_path / name, profile=name == "lisaft_dpo")
        assert r["steps_timed"] == s["steps"] - s["warmup"], name
        if name == "lisaft_dpo":  # the profile tells the matmuls apart by their operands' shapes
            shapes = {m["shapes"] for m in r["profile_matmuls"] if m["op"] == "aten::mm"}
            assert len(shapes) > 1 and all(m["calls_per_step"] > 0 for m in r["profile_matmuls"])
    assert r["steps_per_s"] > 0


def test_the_sides_alternate_and_the_best_round_counts(monkeypatch):
    calls = []
    figures = {"lisaft_lisa": iter([2.0, 3.0]), "hf_lmflow": iter([1.0, 2.0]), "hf_full": iter([1.0, 1.5])}

    def fake(name, s, profile):
        calls.append(name)
        return {"steps_per_s": next(figures[name]), "load_avg_1min": [0.0, 0.0]}

    monkeypatch.setattr(peer_bench, "one_process", fake)
    out = compare("lisa", settings("lisa", "quick", None, 1), repeats=2, profile=False)
    assert calls == ["lisaft_lisa", "hf_lmflow", "hf_full", "hf_full", "hf_lmflow", "lisaft_lisa"]
    assert out["lisaft_lisa_over_hf_lmflow"] == 1.5 and out["lisaft_lisa_over_hf_full"] == 2.0
    s = out["settings"]
    assert out["tokens_per_s"]["lisaft_lisa"] == 3.0 * s["batch_size"] * s["seq_len"]
    json.dumps(out)  # what the result file holds
