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
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learning_bench.py"), "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=280)
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
