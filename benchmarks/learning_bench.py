"""Does lisaft's fine-tuning learn as well as the alternatives? benchmarks/learning_bench.py.

Transfer, so that forgetting shows:

1. Pre-train a small Llama from random init on task family A (the quickstart's string tasks:
   Reverse, Uppercase, Sort) with lisaft full fine-tuning, and save it as a Hugging Face folder
   (save_pretrained, with the quickstart tokenizer).
2. Fine-tune that folder on task family B (Shift, Rotate, Double: new string tasks over the same
   letters, from scripts/make_quickstart_assets.py) with each arm, at equal steps and tokens
   (same batches in the same order for a given seed):

     full            lisaft, full fine-tuning
     lisa_g1         lisaft LISA, γ=1 layer per interval, state policy discard
     lisa_g2         lisaft LISA, γ=2, discard (the paper's recipe)
     lisa_g2_keep    lisaft LISA, γ=2, keep (moments of every sampled layer stay: LMFlow's way)
     emb_head        embeddings + final norm + LM head only, no decoder layer (a plain loop: a
                     lisaft recipe cannot express it, lisa.active_layers is at least 1)
     lora_r8/r16     peft LoRA, rank 8 / 16, alpha 2r, every linear layer of the decoder
     badam           badam.BlockOptimizer, one block per decoder layer, a new block every K steps

   Every arm gets the same learning-rate grid, cosine schedule with warm-up, AdamW (betas 0.9,
   0.999, no weight decay), clipping at 1.0, and the same seeds.
3. Score on B's eval set (new task) and A's (retention): teacher-forced token accuracy along the
   way and at the end, exact match of greedy answers at the end. Per arm, the lr with the best
   mean final B token accuracy is reported as mean ± sd over seeds, with tokens/s, peak RSS, and
   peak optimizer-state and gradient bytes.

A precision arm repeats LISA γ=2 at lr 1e-5 in bfloat16 with each `optimizer.bf16_update` rounding
mode, against float32. If this lisaft has no such recipe key the arm is skipped with a note.

    python benchmarks/learning_bench.py            # full: 3 lrs x 3 seeds, see docs/learning.md
    python benchmarks/learning_bench.py --quick    # 1 seed, 1 lr, tiny shapes: about a minute

Writes learning.json, learning.md and PNG plots into --out (default benchmarks/results/learning,
or benchmarks/results/learning-quick with --quick). Needs the `bench` extra (peft, badam,
matplotlib); without peft or badam their arms are skipped with a note, without matplotlib the
plots are.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import random
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

TOKENIZER = REPO / "recipes" / "quickstart" / "tokenizer"
SETTINGS = {
    "full": dict(layers=6, hidden=128, intermediate=384, pretrain_steps=1200, pretrain_batch_size=32,
                 pretrain_lr=3e-3, pretrain_warmup_steps=50, new_train_rows=3000, eval_rows=200,
                 steps=300, batch_size=16, interval_steps=20, warmup_steps=20, eval_every=30,
                 curve_examples=100, final_examples=200, max_seq_len=64,
                 lrs=[3e-4, 1e-3, 3e-3], seeds=[0, 1, 2], precision_lr=1e-5),
    "quick": dict(layers=4, hidden=64, intermediate=192, pretrain_steps=150, pretrain_batch_size=32,
                  pretrain_lr=3e-3, pretrain_warmup_steps=10, new_train_rows=600, eval_rows=60,
                  steps=30, batch_size=16, interval_steps=5, warmup_steps=3, eval_every=10,
                  curve_examples=40, final_examples=60, max_seq_len=64,
                  lrs=[3e-3], seeds=[0], precision_lr=1e-5),
}
NEEDS = {"lora_r8": "peft", "lora_r16": "peft", "badam": "badam"}


def write_families(data_dir: Path, s: dict) -> None:
    """Family A is the quickstart's own data; family B the new tasks, with disjoint inputs."""
    import make_quickstart_assets as gen

    data_dir.mkdir(parents=True, exist_ok=True)
    a_train, a_eval = gen.make_rows(random.Random(gen.SEED))
    b_train, b_eval = gen.task_rows(gen.FAMILIES["B"], random.Random(gen.SEED + 1), s["new_train_rows"],
                                    s["eval_rows"])
    for name, rows in (("A_train", a_train), ("A_eval", a_eval[:s["eval_rows"]]),
                       ("B_train", b_train), ("B_eval", b_eval)):
        gen.write_jsonl(data_dir / f"{name}.jsonl", rows)


def model_config(s: dict) -> dict:
    import make_quickstart_assets as gen
    from transformers import AutoTokenizer

    cfg = gen.llama_config(len(AutoTokenizer.from_pretrained(str(TOKENIZER))))
    cfg.update(num_hidden_layers=s["layers"], hidden_size=s["hidden"], intermediate_size=s["intermediate"])
    return cfg


def pretrain(work: Path, s: dict) -> dict:
    """Family A from random init with lisaft full fine-tuning; saved as an HF folder."""
    import torch

    from benchmarks.learning.arms import load_data, lisaft_recipe, scores
    from lisaft.data import load_splits
    from lisaft.recipe import DataSection
    from lisaft.trainer import build_session, train_step

    target = work / "pretrained"
    (work / "config.json").write_text(json.dumps(model_config(s), indent=2))
    data = load_data(str(work / "data"), str(TOKENIZER), s["max_seq_len"])
    a_train, _ = load_splits(DataSection(train=str(work / "data" / "A_train.jsonl"), format="instruction",
                                         max_seq_len=s["max_seq_len"]), data.tokenizer, 0)
    job = {"arm": "pretrain", "seed": 0, "tokenizer": str(TOKENIZER),
           "settings": {**s, "batch_size": s["pretrain_batch_size"], "warmup_steps": s["pretrain_warmup_steps"]}}
    recipe = lisaft_recipe(job, {"lisa": None}, {"config": str(work / "config.json")}, work / "pretrain-run",
                           s["pretrain_steps"], s["pretrain_lr"])
    session = build_session(recipe, work / "pretrain-run", tokenizer=data.tokenizer, train_examples=a_train,
                            eval_examples=None)
    t0 = time.perf_counter()
    for step in range(s["pretrain_steps"]):
        loss, _ = train_step(session, step)
        if (step + 1) % 100 == 0:
            print(f"pre-train step {step + 1}/{s['pretrain_steps']}  loss {loss:.4f}", flush=True)
    train_s = time.perf_counter() - t0
    session.model.save_pretrained(str(target))
    data.tokenizer.save_pretrained(str(target))
    with torch.no_grad():
        base = scores(session.model, data, s["final_examples"], generate=True)
    return {"steps": s["pretrain_steps"], "train_s": train_s, "last_loss": loss, "scores": base}


def jobs_for(s: dict, work: Path, threads: int, precision: bool) -> list[dict]:
    from benchmarks.learning.arms import ARMS, PRECISION_ARMS

    common = {"settings": s, "pretrained": str(work / "pretrained"), "tokenizer": str(work / "pretrained"),
              "data_dir": str(work / "data"), "threads": threads}
    jobs = [{**common, "arm": arm, "lr": lr, "seed": seed}
            for seed in s["seeds"] for lr in s["lrs"] for arm in ARMS
            if importlib.util.find_spec(NEEDS.get(arm, "torch")) is not None]
    if precision:
        jobs += [{**common, "arm": arm, "lr": s["precision_lr"], "seed": s["seeds"][0], "precision": True}
                 for arm in PRECISION_ARMS]
    return jobs


def run_all(jobs: list[dict], workers: int) -> list[dict]:
    from benchmarks.learning.arms import run_job

    def show(r: dict, k: int) -> None:
        f = r["final"]
        print(f"[{k}/{len(jobs)}] {r['arm']:<16} lr {r['lr']:<7g} seed {r['seed']}  "
              f"B acc {100 * f['new_token_accuracy']:5.1f} EM {100 * f['new_exact_match']:5.1f}  "
              f"A acc {100 * f['old_token_accuracy']:5.1f} EM {100 * f['old_exact_match']:5.1f}  "
              f"{r['tokens_per_s']:.0f} tok/s", flush=True)

    results = []
    if workers <= 1:
        for job in jobs:
            results.append({**run_job(job), "precision": bool(job.get("precision"))})
            show(results[-1], len(results))
        return results
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for job, r in zip(jobs, pool.map(run_job, jobs)):
            results.append({**r, "precision": bool(job.get("precision"))})
            show(results[-1], len(results))
    return results


def environment(threads: int, workers: int) -> dict:
    import torch

    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": version("transformers"),
            "peft": version("peft"), "badam": version("badam"), "cpu_count": os.cpu_count(),
            "threads_per_run": threads, "workers": workers, "platform": platform.platform()}


def summarise(mode: str, s: dict, pre: dict, runs: list[dict], precision_note: str | None, env: dict) -> dict:
    from benchmarks.learning import report
    from benchmarks.learning.arms import ARMS

    baseline = pre["scores"]
    arms, notes = {}, []
    for name in ARMS:
        rs = [r for r in runs if r["arm"] == name and not r["precision"]]
        if rs:
            arms[name] = {"status": "ok", **report.summarise_arm(rs, s["lrs"], baseline)}
        else:
            note = f"{NEEDS[name]} is not installed (pip install 'lisaft[bench]')"
            arms[name] = {"status": "skipped", "note": note}
            notes.append(f"{name} skipped: {note}")
    if precision_note:
        precision = {"status": "skipped", "note": precision_note}
        notes.append(f"precision arm skipped: {precision_note}")
    else:
        precision = {"status": "ok", "lr": s["precision_lr"], "seed": s["seeds"][0], "base_arm": "lisa_g2",
                     "runs": {r["arm"]: {"final": r["final"], "curve": r["curve"]} for r in runs if r["precision"]}}
    learned = {n: a["new_token_accuracy"]["mean"] > baseline["new_token_accuracy"]
               for n, a in arms.items() if a["status"] == "ok"}
    return {"benchmark": "learning", "mode": mode, "settings": s, "environment": env, "pretraining": pre,
            "baseline": baseline, "arms": arms, "learned": learned, "targets": report.targets(
                {n: a for n, a in arms.items() if a["status"] == "ok"}),
            "not_expressible_as_recipe": {"emb_head": "lisa.active_layers must be >= 1, so a recipe always trains "
                                                      "at least one decoder layer; emb_head runs in the plain loop"},
            "precision": precision, "notes": notes, "runs": [r for r in runs if not r["precision"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 lr, tiny model: about a minute")
    ap.add_argument("--out", type=Path, help="results folder")
    ap.add_argument("--workers", type=int, default=None, help="runs in parallel (default: 1 quick, 2 full)")
    ap.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    ap.add_argument("--steps", type=int, help="override the fine-tuning steps")
    ap.add_argument("--lrs", type=float, nargs="+", help="override the learning-rate grid")
    args = ap.parse_args()
    mode = "quick" if args.quick else "full"
    s = dict(SETTINGS[mode])
    if args.seeds:
        s["seeds"] = args.seeds
    if args.steps:
        s["steps"] = args.steps
    if args.lrs:
        s["lrs"] = args.lrs
    out = args.out or REPO / "benchmarks" / "results" / ("learning-quick" if args.quick else "learning")
    workers = args.workers or (1 if args.quick else 2)
    threads = 1 if workers > 1 else max(1, min(2, os.cpu_count() or 1))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging as hf_logging

    from lisaft.recipe import OptimizerSection

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    write_families(work / "data", s)
    pre = pretrain(work, s)
    print(f"pre-trained on A in {pre['train_s']:.0f} s: A exact match {100 * pre['scores']['old_exact_match']:.1f}%, "
          f"B token acc {100 * pre['scores']['new_token_accuracy']:.1f}%", flush=True)
    precision_note = None if "bf16_update" in OptimizerSection.model_fields else (
        "this lisaft has no recipe key optimizer.bf16_update (it arrives with issue 10)")
    runs = run_all(jobs_for(s, work, threads, precision_note is None), workers)
    summary = summarise(mode, s, pre, runs, precision_note, environment(threads, workers))
    summary["wall_s"] = time.perf_counter() - t0
    table = __import__("benchmarks.learning.report", fromlist=["markdown"]).markdown(summary)
    if importlib.util.find_spec("matplotlib") is not None:
        from benchmarks.learning.report import plots

        summary["plots"] = plots(summary, out)
    else:
        summary["notes"].append("plots skipped: matplotlib is not installed (pip install 'lisaft[bench]')")
    (out / "learning.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "learning.md").write_text(table)
    shutil.rmtree(work, ignore_errors=True)
    print(table)
    print(f"wrote {out} in {summary['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
