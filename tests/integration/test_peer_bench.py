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
        rate = next(figures[name])
        return {"steps_per_s": rate, "step_s_median": 1 / rate, "load_avg_1min": [0.0, 0.0]}

    monkeypatch.setattr(peer_bench, "one_process", fake)
    out = compare("lisa", settings("lisa", "quick", None, 1), repeats=2, profile=False)
    assert calls == ["lisaft_lisa", "hf_lmflow", "hf_full", "hf_full", "hf_lmflow", "lisaft_lisa"]
    assert out["lisaft_lisa_over_hf_lmflow"] == 1.5 and out["lisaft_lisa_over_hf_full"] == 2.0
    s = out["settings"]
    assert out["tokens_per_s"]["lisaft_lisa"] == 3.0 * s["batch_size"] * s["seq_len"]
    json.dumps(out)  # what the result file holds
    figures.update(lisaft_lisa_compiled=iter([4.0]), hf_lmflow_compiled=iter([2.5]), hf_lmflow=iter([2.0]),
                   hf_full=iter([1.6]), lisaft_lisa=iter([3.2]))
    out = compare("lisa_compiled", settings("lisa_compiled", "quick", None, 1), repeats=1, profile=False)
    assert (out["lisaft_lisa_compiled_over_hf_lmflow_compiled"], out["lisaft_lisa_compiled_over_hf_lmflow"],
            out["lisaft_lisa_compiled_over_hf_full"], out["lisaft_lisa_compiled_over_lisaft_lisa"]) == (
        1.6, 2.0, 2.5, 1.25)  # against each peer, compiled or not, and against lisaft's eager LISA
    assert out["by_median_step"]["lisaft_lisa_compiled_over_hf_lmflow_compiled"] == 1.6


def test_the_step_probe_logs_each_call_with_its_operands_layout_and_diffs_two_logs():
    import torch

    from benchmarks.step_probe import call_line, diff, fresh_bytes

    a, w = torch.randn(4, 3), torch.randn(5, 3)
    mm = torch.ops.aten.mm.default
    logs = []
    for weight in (w.t(), w.t().contiguous()):  # the same product, the weight in two layouts
        out = mm(a, weight)
        assert fresh_bytes((a, weight), {}, out) == 4 * 5 * 4  # the product's own buffer
        logs.append({"op_counts": {call_line(mm, (a, weight), {}): 1}})
    assert fresh_bytes((a, w), {"out": out}, out) == 0  # an out= call allocates nothing
    assert logs[0]["op_counts"] == {"aten.mm.default(float32[4, 3]/[3, 1], float32[3, 5]/[1, 3] nc)": 1}
    assert diff(logs[0], logs[1], ("t", "contiguous")) == [
        "== more in t: 1 calls", "    1  aten.mm.default(float32[4, 3]/[3, 1], float32[3, 5]/[1, 3] nc)",
        "== more in contiguous: 1 calls", "    1  aten.mm.default(float32[4, 3]/[3, 1], float32[3, 5]/[5, 1])"]


def test_the_committed_result_names_the_real_model_folder_not_this_machines_path(tmp_path):
    folder = tmp_path / "models" / "smollm2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    result = {"command": f"python -m benchmarks.peer_bench --real-model {folder}",
              "comparisons": {"real/full": {"settings": settings("full", "real", folder, 2)}}}
    written = json.loads(peer_bench.portable(json.dumps(result, indent=1), folder))
    assert written["command"] == "python -m benchmarks.peer_bench --real-model REAL_MODEL"
    assert written["comparisons"]["real/full"]["settings"]["model_path"] == "REAL_MODEL"
    assert str(tmp_path) not in json.dumps(written)
    assert peer_bench.portable("unchanged", None) == "unchanged"
