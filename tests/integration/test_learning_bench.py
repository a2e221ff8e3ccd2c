"""benchmarks/learning_bench.py --quick: every arm runs, scores and learns something on the new
task, and the results have the documented shape. The real comparison is the full mode
(docs/learning.md); this keeps its code path from rotting."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARMS = {"full", "lisa_g1", "lisa_g2", "lisa_g2_keep", "emb_head", "lora_r8", "lora_r16", "badam"}
NEEDS = {"lora_r8": "peft", "lora_r16": "peft", "badam": "badam"}
MEASURES = {"new_token_accuracy", "new_exact_match", "old_token_accuracy", "old_exact_match"}


def test_learning_bench_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.learning_bench", "--quick",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "learning.json").read_text())
    s = summary["settings"]
    assert summary["mode"] == "quick" and len(s["seeds"]) == 1
    assert set(summary["arms"]) == ARMS
    assert not (tmp_path / "work").exists()  # the pre-trained model and data are scratch

    base = summary["baseline"]
    assert MEASURES <= set(base)
    ran = set()
    for name, arm in summary["arms"].items():
        if arm["status"] == "skipped":
            assert importlib.util.find_spec(NEEDS[name]) is None, name
            assert NEEDS[name] in arm["note"]
            continue
        ran.add(name)
        assert arm["best_lr"] in s["lrs"]
        for m in MEASURES:
            assert 0.0 <= arm[m]["mean"] <= 1.0 and arm[m]["n"] == len(s["seeds"]), (name, m)
        # Learned something: the new task's token accuracy rose above the pre-trained model's.
        assert arm["new_token_accuracy"]["mean"] > base["new_token_accuracy"], name
        assert summary["learned"][name] is True
        assert [c["step"] for c in arm["curve"]][0] == 0 and arm["curve"][-1]["step"] == s["steps"]
        assert arm["tokens_per_s_median"] > 0 and arm["tokens_per_run"] > 0
        assert arm["peak_optimizer_state_bytes"] > 0 and arm["peak_grad_bytes"] > 0, name
    assert {"full", "lisa_g1", "lisa_g2", "lisa_g2_keep", "emb_head"} <= ran
    runs = summary["runs"]
    assert len(runs) == len(ran) * len(s["lrs"]) * len(s["seeds"])
    # Equal steps and tokens: every arm saw the same batches.
    assert len({r["tokens"] for r in runs}) == 1
    a = summary["arms"]
    # γ=2 with discard holds moments of two layers plus embeddings and head; keep holds more once
    # a third layer was sampled, and full fine-tuning holds every layer's.
    assert a["lisa_g1"]["peak_optimizer_state_bytes"] < a["lisa_g2"]["peak_optimizer_state_bytes"] \
        < a["full"]["peak_optimizer_state_bytes"]
    assert a["lisa_g2_keep"]["peak_optimizer_state_bytes"] > a["lisa_g2"]["peak_optimizer_state_bytes"]

    p = summary["precision"]
    if p["status"] == "skipped":
        assert "optimizer.bf16_update" in p["note"]
    else:
        assert set(p["runs"]) == {"fp32", "bf16_stochastic", "bf16_nearest"}
    if importlib.util.find_spec("matplotlib") is not None:
        for png in ("accuracy_new_task.png", "accuracy_old_task.png", "memory.png"):
            assert (tmp_path / png).stat().st_size > 0
    assert "| lisa_g2 |" in (tmp_path / "learning.md").read_text()


def test_learning_bench_second_protocol_quick(tmp_path):
    """--protocol 2 --quick: two depths, both task kinds, the validation/test split, the equal-memory
    LoRA, both samplings, and the tables built from them."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.learning_bench", "--protocol", "2",
                           "--quick", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "learning2.json").read_text())
    assert summary["protocol"] == 2 and summary["mode"] == "quick"
    assert set(summary["pretraining"]) == {"4", "8"}
    res = summary["results"]
    assert set(res) == {"new_skill", "new_format"} and set(res["new_skill"]) == {"4", "8"}
    if importlib.util.find_spec("peft") is None:
        return
    d4 = res["new_skill"]["4"]
    assert set(d4) == {"full", "lisa_g2_uniform", "lisa_g2_cyclic", "lora_eq_g2"}
    for arm in d4.values():
        for m in ("test_token_accuracy", "test_exact_match", "old_token_accuracy", "val_token_accuracy"):
            assert 0.0 <= arm[m]["mean"] <= 1.0
        assert arm["best_lr"] in arm["grid"]
    # Validation and test are different rows: their accuracies differ somewhere.
    assert any(a["val_token_accuracy"]["mean"] != a["test_token_accuracy"]["mean"] for a in d4.values())
    # The equal-memory LoRA keeps LISA γ=2's optimizer-state bytes, within one rank's worth.
    lisa, lora = d4["lisa_g2_uniform"], d4["lora_eq_g2"]
    assert abs(lora["peak_optimizer_state_bytes"] - lisa["peak_optimizer_state_bytes"]) \
        < lisa["peak_optimizer_state_bytes"] / lora["lora_rank"]
    assert set(summary["depth_gap"]["new_skill"]) == {"4", "8"}
    assert "new_skill/4/lisa_g2" in summary["sampling"] and "new_format/4" in summary["equal_memory"]
    md = (tmp_path / "learning2.md").read_text()
    assert "Equal optimizer-state bytes" in md and "Uniform against cyclic" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "depth_gap_new_skill.png").stat().st_size > 0
        assert (tmp_path / "front_new_skill_d4.png").stat().st_size > 0


def test_second_protocol_resume_runs_only_what_is_missing(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks.learning import protocol2, run2

    out = tmp_path / "out"
    bench = run2.Bench("quick", out, workers=1, resume=False)
    jobs = bench.jobs(4, ["new_skill"], ["full", "lisa_g2_cyclic"], [3e-3], [0], 1)
    recorded = {"task": "new_skill", "arm": "full", "marker": "from the log"}
    bench.log.write_text(json.dumps({"key": protocol2.key(jobs[0]), "run": recorded}) + "\n")
    ran = []

    def fake_run(job):
        ran.append(job["arm"])
        return {"depth": 4, "task": job["task"], "arm": job["arm"], "lr": job["lr"], "seed": job["seed"],
                "tokens_per_s": 1.0, "final": dict.fromkeys(("val_token_accuracy", "test_token_accuracy",
                                                              "old_token_accuracy"), 0.5)}

    monkeypatch.setattr(protocol2, "run_job", fake_run)
    resumed = run2.Bench("quick", out, workers=1, resume=True)
    got = resumed.run(jobs)
    assert got[0] == recorded and ran == ["lisa_g2_cyclic"]
    assert len(resumed.log.read_text().splitlines()) == 2  # the new run was appended as it finished
    assert run2.Bench("quick", out, workers=1, resume=True).run(jobs) == got and ran == ["lisa_g2_cyclic"]
    fresh = run2.Bench("quick", out, workers=1, resume=False)
    assert not fresh.log.exists()  # without --resume the old log is not reused
