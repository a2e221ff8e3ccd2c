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

    python -m benchmarks.learning_bench            # full: 3 lrs x 3 seeds, see docs/learning.md
    python -m benchmarks.learning_bench --quick    # 1 seed, 1 lr, tiny shapes: about a minute
    python -m benchmarks.learning_bench --protocol 2 [--reduced | --quick]   # the second protocol:
        validation/test splits, depths, equal memory, two task kinds (benchmarks/learning/protocol2.py)

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

TOKENIZER = REPO / "recipes" / "quickstart" / "tokenizer"
SETTINGS = {
    "full": dict(layers=6, hidden=128, intermediate=384, pretrain_steps=1200, pretrain_batch_size=32,
                 pretrain_lr=3e-3, pretrain_warmup_steps=50, new_train_rows=3000, eval_rows=200,
                 steps=200, batch_size=16, interval_steps=20, warmup_steps=20, eval_every=25,
                 curve_examples=60, final_examples=200, max_seq_len=64,
                 lrs=[3e-4, 1e-3, 3e-3], seeds=[0, 1, 2], sweep_all_seeds=True, precision_lr=1e-5),
    "quick": dict(layers=4, hidden=64, intermediate=192, pretrain_steps=60, pretrain_batch_size=32,
                  pretrain_lr=3e-3, pretrain_warmup_steps=6, new_train_rows=400, eval_rows=30,
                  steps=30, batch_size=16, interval_steps=5, warmup_steps=2, eval_every=10,
                  curve_examples=24, final_examples=30, max_seq_len=64,
                  lrs=[3e-3], seeds=[0], precision_lr=1e-5),
}
NEEDS = {"lora_r8": "peft", "lora_r16": "peft", "badam": "badam"}


def write_families(data_dir: Path, s: dict) -> None:
    """Family A is the quickstart's own data; family B the new tasks, with disjoint inputs."""
    from scripts import make_quickstart_assets as gen

    data_dir.mkdir(parents=True, exist_ok=True)
    a_train, a_eval = gen.make_rows(random.Random(gen.SEED))
    b_train, b_eval = gen.task_rows(gen.FAMILIES["B"], random.Random(gen.SEED + 1), s["new_train_rows"],
                                    s["eval_rows"])
    for name, rows in (("A_train", a_train), ("A_eval", a_eval[:s["eval_rows"]]),
                       ("B_train", b_train), ("B_eval", b_eval)):
        gen.write_jsonl(data_dir / f"{name}.jsonl", rows)


def model_config(s: dict) -> dict:
    from transformers import AutoTokenizer

    from scripts import make_quickstart_assets as gen

    cfg = gen.llama_config(len(AutoTokenizer.from_pretrained(str(TOKENIZER))))
    cfg.update(num_hidden_layers=s["layers"], hidden_size=s["hidden"], intermediate_size=s["intermediate"])
    return cfg


def pretrain(work: Path, s: dict) -> dict:
    """Family A from random init with lisaft full fine-tuning; saved as an HF folder."""
    import torch

    from benchmarks.learning.arms import load_data, pretrain_family_a, scores

    target = work / "pretrained"
    (work / "config.json").write_text(json.dumps(model_config(s), indent=2))
    data = load_data(str(work / "data"), str(TOKENIZER), s["max_seq_len"])
    model, loss, started = pretrain_family_a(work, s, work / "data", data.tokenizer, str(TOKENIZER), log_every=100)
    train_s = time.perf_counter() - started
    with torch.no_grad():
        base = scores(model, data, s["final_examples"], generate=True)
    record = {"steps": s["pretrain_steps"], "train_s": train_s, "last_loss": loss, "scores": base}
    (target / "pretraining.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def reuse_pretrained(work: Path, source: Path, s: dict) -> dict:
    """A folder an earlier run of the same settings pre-trained (pre-training is deterministic on
    CPU, so this skips minutes without changing the model)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.learning.arms import load_data, scores

    if source.resolve() != (work / "pretrained").resolve():
        shutil.rmtree(work / "pretrained", ignore_errors=True)
        shutil.copytree(source, work / "pretrained")
    info = source / "pretraining.json"
    record = json.loads(info.read_text()) if info.is_file() else {"steps": s["pretrain_steps"]}
    data = load_data(str(work / "data"), str(TOKENIZER), s["max_seq_len"])
    model = AutoModelForCausalLM.from_pretrained(str(source), attn_implementation="sdpa")
    record["scores"] = scores(model, data, s["final_examples"], generate=True)
    return {**record, "reused_from_earlier_run": True}


def jobs_for(s: dict, work: Path, threads: int, arms: dict[str, list[float]], seeds: list[int]) -> list[dict]:
    """A run per arm, per lr listed for it, per seed."""
    common = {"settings": s, "pretrained": str(work / "pretrained"), "tokenizer": str(work / "pretrained"),
              "data_dir": str(work / "data"), "threads": threads}
    return [{**common, "arm": arm, "lr": lr, "seed": seed} for seed in seeds for arm, lrs in arms.items()
            for lr in lrs]


def precision_jobs(s: dict, work: Path, threads: int) -> list[dict]:
    from benchmarks.learning.arms import PRECISION_ARMS

    jobs = jobs_for(s, work, threads, {arm: [s["precision_lr"]] for arm in PRECISION_ARMS}, s["seeds"][:1])
    return [{**j, "precision": True} for j in jobs]


def sweep_then_seeds(s: dict, work: Path, threads: int, workers: int, resume: bool, run: bool) -> list[dict]:
    """The lr grid on the sweep seeds; any other seed at each arm's best lr on them."""
    from benchmarks.learning.arms import ARMS
    from benchmarks.learning.report import best_lr, sweep_seeds

    arms = [a for a in ARMS if importlib.util.find_spec(NEEDS.get(a, "torch")) is not None]
    log = work / "runs.jsonl"
    seeds = sweep_seeds(s)
    sweep = run_all(jobs_for(s, work, threads, {a: s["lrs"] for a in arms}, seeds), workers, log, resume, run)
    best = {a: [best_lr(rs)] for a in arms if (rs := [r for r in sweep if r["arm"] == a])}
    rest = [seed for seed in s["seeds"] if seed not in seeds]
    return sweep + run_all(jobs_for(s, work, threads, best, rest), workers, log, True, run)


def _key(job: dict) -> str:
    # What a run depends on; how the seeds were split between sweep and reruns is not part of it.
    s = {k: v for k, v in job["settings"].items() if k != "sweep_all_seeds"}
    return json.dumps([job["arm"], job["lr"], job["seed"], bool(job.get("precision")), s])


def run_all(jobs: list[dict], workers: int, log: Path, resume: bool, run: bool = True) -> list[dict]:
    """Every job's run record; each is also appended to `log` as it finishes, so that --resume
    after a crash reruns only the jobs that have no record there. run=False: only the recorded."""
    from benchmarks.learning.arms import run_job

    done = {}
    if resume and log.is_file():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            done[rec["key"]] = rec["run"]
    elif log.exists():
        log.unlink()  # a fresh run
    todo = [j for j in jobs if _key(j) not in done] if run else []
    print(f"{len(jobs) - len(todo)} runs taken from {log}, {len(todo)} to run", flush=True)

    def show(r: dict, k: int) -> None:
        f = r["final"]
        print(f"[{k}/{len(todo)}] {r['arm']:<16} lr {r['lr']:<7g} seed {r['seed']}  "
              f"B acc {100 * f['new_token_accuracy']:5.1f} EM {100 * f['new_exact_match']:5.1f}  "
              f"A acc {100 * f['old_token_accuracy']:5.1f} EM {100 * f['old_exact_match']:5.1f}  "
              f"{r['tokens_per_s']:.0f} tok/s", flush=True)

    def record(job: dict, r: dict, k: int) -> None:
        done[_key(job)] = {**r, "precision": bool(job.get("precision"))}
        with log.open("a") as f:
            f.write(json.dumps({"key": _key(job), "run": done[_key(job)]}) + "\n")
        show(r, k)

    if workers <= 1:
        for k, job in enumerate(todo, 1):
            record(job, run_job(job), k)
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for k, (job, r) in enumerate(zip(todo, pool.map(run_job, todo)), 1):
                record(job, r, k)
    return [done[_key(j)] for j in jobs if _key(j) in done]


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


def precision_section(s: dict, runs: list[dict], note: str | None) -> dict:
    if note:
        return {"status": "skipped", "note": note}
    return {"status": "ok", "lr": s["precision_lr"], "seed": s["seeds"][0], "base_arm": "lisa_g2",
            "runs": {r["arm"]: {"final": r["final"], "curve": r["curve"]} for r in runs if r["precision"]}}


def summarise(mode: str, s: dict, pre: dict, runs: list[dict], precision_note: str | None, env: dict) -> dict:
    from benchmarks.learning import report
    from benchmarks.learning.arms import ARMS

    baseline = pre["scores"]
    arms, notes = {}, []
    for name in ARMS:
        rs = [r for r in runs if r["arm"] == name and not r["precision"]]
        if rs:
            arms[name] = {"status": "ok", **report.summarise_arm(rs, s, baseline)}
        else:
            note = f"{NEEDS[name]} is not installed (pip install 'lisaft[bench]')"
            arms[name] = {"status": "skipped", "note": note}
            notes.append(f"{name} skipped: {note}")
    precision = precision_section(s, runs, precision_note)
    if precision_note:
        notes.append(f"precision arm skipped: {precision_note}")
    learned = {n: a["new_token_accuracy"]["mean"] > baseline["new_token_accuracy"]
               for n, a in arms.items() if a["status"] == "ok"}
    return {"benchmark": "learning", "mode": mode, "settings": s, "environment": env, "pretraining": pre,
            "baseline": baseline, "arms": arms, "learned": learned, "targets": report.targets(
                {n: a for n, a in arms.items() if a["status"] == "ok"}),
            "not_expressible_as_recipe": {"emb_head": "lisa.active_layers must be >= 1, so a recipe always trains "
                                                      "at least one decoder layer; emb_head runs in the plain loop"},
            "precision": precision, "notes": notes, "runs": [r for r in runs if not r["precision"]]}


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", type=int, choices=(1, 2), default=1, help="1: the first protocol (one depth, "
                    "one task, equal steps); 2: validation/test splits, depths, equal memory, two task kinds "
                    "(benchmarks/learning/protocol2.py)")
    ap.add_argument("--reduced", action="store_true", help="protocol 2 only: the cut-down run that fits an hour "
                    "on a shared 2-core machine (docs/learning.md says what it cuts)")
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 lr, tiny model: about a minute")
    ap.add_argument("--apollo", action="store_true", help="protocol 2 only: the apollo arms against LISA γ=2 and "
                    "equal-memory LoRA at depths 24 and 6, lr grid, 3 seeds (about 2 hours; protocol2.py)")
    ap.add_argument("--lora-smoke", action="store_true", help="protocol 2 only: LISA γ=2 and the LoRA, DoRA and "
                    "QLoRA arms at LISA γ=2's memory, depth 6, one seed and lr, a short pre-training")
    ap.add_argument("--preference", action="store_true", help="protocol 2 only: the preference protocol, DPO, "
                    "SimPO and ORPO with full, LISA, LoRA and APOLLO-Mini (benchmarks/learning/preference.py)")
    ap.add_argument("--onpolicy", action="store_true", help="protocol 2 only: the on-policy preference protocol, "
                    "DPO and KTO on the pre-trained model's own wrong answers, every method at equal memory, an lr "
                    "sweep, 3 seeds (benchmarks/learning/onpolicy.py)")
    ap.add_argument("--lr-scale", type=float, default=1.0, help="--preference only: every arm's lr times this "
                    "(its protocol 2 pick is an SFT lr)")
    ap.add_argument("--out", type=Path, help="results folder")
    ap.add_argument("--workers", type=int, default=None, help="runs in parallel (default: 1 quick, 2 full)")
    ap.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    ap.add_argument("--steps", type=int, help="override the fine-tuning steps")
    ap.add_argument("--lrs", type=float, nargs="+", help="override the learning-rate grid")
    ap.add_argument("--sweep-on-first-seed", action="store_true", help="run the lr grid on the first seed only "
                    "and the other seeds at each arm's best lr there (40 runs instead of 72)")
    ap.add_argument("--resume", action="store_true", help="keep the runs an interrupted run of the same "
                    "settings recorded in OUT/work/runs.jsonl (use with --pretrained OUT/work/pretrained)")
    ap.add_argument("--report-only", action="store_true", help="summarise what OUT/work/runs.jsonl holds, "
                    "running nothing (with --pretrained OUT/work/pretrained)")
    ap.add_argument("--precision-only", action="store_true", help="run only the precision arm and add it to "
                    "OUT/learning.json, keeping everything else there")
    ap.add_argument("--pretrained", type=Path, help="reuse the pre-trained folder of an earlier run with the same "
                    "settings (its work/pretrained) instead of pre-training again")
    return ap.parse_args()


def settings(args: argparse.Namespace, out: Path) -> dict:
    if args.precision_only:
        return json.loads((out / "learning.json").read_text())["settings"]
    s = dict(SETTINGS["quick" if args.quick else "full"])
    for key in ("seeds", "steps", "lrs"):
        if getattr(args, key):
            s[key] = getattr(args, key)
    if args.sweep_on_first_seed:
        s["sweep_all_seeds"] = False
    return s


def write(summary: dict, out: Path) -> str:
    from benchmarks.learning import report

    table = report.markdown(summary)
    if importlib.util.find_spec("matplotlib") is not None:
        summary["plots"] = report.plots(summary, out)
    elif not any(n.startswith("plots skipped") for n in summary["notes"]):
        summary["notes"].append("plots skipped: matplotlib is not installed (pip install 'lisaft[bench]')")
    (out / "learning.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "learning.md").write_text(table)
    return table


def main_preference(args: argparse.Namespace) -> None:
    from benchmarks.learning import preference

    mode = "quick" if args.quick else "run"
    out = args.out or REPO / "benchmarks" / "results" / ("learning-pref-quick" if args.quick else "learning-pref")
    if args.lr_scale != 1.0 and not args.out:
        out = out / f"lr-x{args.lr_scale:g}"
    workers = args.workers or (1 if args.quick else 2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    preference.main(mode, out, workers, args.resume, environment(1, workers), REPO, args.lr_scale)
    shutil.rmtree(out / "work" / "data", ignore_errors=True)
    if args.quick:
        shutil.rmtree(out / "work", ignore_errors=True)
    print((out / "learning-pref.md").read_text())
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


def main_onpolicy(args: argparse.Namespace) -> None:
    from benchmarks.learning import onpolicy

    mode = "quick" if args.quick else "run"
    out = args.out or REPO / "benchmarks" / "results" / ("learning-onpolicy-quick" if args.quick else
                                                         "learning-onpolicy")
    workers = args.workers or (1 if args.quick else 2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    onpolicy.main(mode, out, workers, args.resume, environment(1, workers), REPO)
    shutil.rmtree(out / "work" / "data", ignore_errors=True)
    if args.quick:
        shutil.rmtree(out / "work", ignore_errors=True)
    print((out / "learning-onpolicy.md").read_text())
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


def main_protocol2(args: argparse.Namespace) -> None:
    from benchmarks.learning import run2

    if args.preference:
        main_preference(args)
        return
    if args.onpolicy:
        main_onpolicy(args)
        return

    mode = ("quick" if args.quick else "reduced" if args.reduced else "apollo" if args.apollo
            else "lora-smoke" if args.lora_smoke else "full")
    out = args.out or REPO / "benchmarks" / "results" / ("learning2" if mode == "full" else f"learning2-{mode}")
    workers = args.workers or (1 if args.quick else 2)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.perf_counter()
    run2.main(mode, out, workers, args.resume, environment(1, workers))
    if args.quick:
        shutil.rmtree(out / "work", ignore_errors=True)
    print((out / "learning2.md").read_text())
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


def main() -> None:
    args = parse_args()
    if args.protocol == 2:
        main_protocol2(args)
        return
    mode = "quick" if args.quick else "full"
    out = args.out or REPO / "benchmarks" / "results" / ("learning-quick" if args.quick else "learning")
    if args.precision_only and not (out / "learning.json").is_file():
        _fail(f"--precision-only adds to {out / 'learning.json'}, which does not exist; run the benchmark first")
    s = settings(args, out)
    workers = args.workers or (1 if args.quick else 2)
    # One thread per run: on a shared machine a second thread mostly spins waiting for the first.
    threads = 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers.utils import logging as hf_logging

    from lisaft.config.schema import OptimizerSection

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    precision_note = None if "bf16_update" in OptimizerSection.model_fields else (
        "this lisaft has no recipe key optimizer.bf16_update (it arrives with issue 10)")
    if args.precision_only and precision_note:
        _fail(f"--precision-only: {precision_note}")
    t0 = time.perf_counter()
    work = out / "work"
    shutil.rmtree(work / "data", ignore_errors=True)
    write_families(work / "data", s)
    pre = reuse_pretrained(work, args.pretrained, s) if args.pretrained else pretrain(work, s)
    print(f"pre-trained model: A exact match {100 * pre['scores']['old_exact_match']:.1f}%, "
          f"B token acc {100 * pre['scores']['new_token_accuracy']:.1f}%", flush=True)
    log, run = work / "runs.jsonl", not args.report_only
    if args.precision_only:
        summary = json.loads((out / "learning.json").read_text())
        summary["precision"] = precision_section(s, run_all(precision_jobs(s, work, threads), workers, log, True), None)
        summary["notes"] = [n for n in summary["notes"] if not n.startswith("precision arm skipped")]
    else:
        runs = sweep_then_seeds(s, work, threads, workers, args.resume or args.report_only, run)
        if precision_note is None:
            runs += run_all(precision_jobs(s, work, threads), workers, log, True, run)
        summary = summarise(mode, s, pre, runs, precision_note, environment(threads, workers))
        summary["wall_s"] = time.perf_counter() - t0
    table = write(summary, out)
    shutil.rmtree(work / "data", ignore_errors=True)
    if args.quick:
        shutil.rmtree(work, ignore_errors=True)
    print(table)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
