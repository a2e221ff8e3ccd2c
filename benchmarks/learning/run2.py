"""Drives the second protocol (benchmarks/learning/protocol2.py): data, one pre-trained model per
depth, the stages of runs, the edge extensions, and the partial results after every stage."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks.learning import protocol2 as p2

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "recipes" / "quickstart" / "tokenizer"


def pretrain(job: dict) -> dict:
    """Family A from random init with lisaft full fine-tuning, saved as an HF folder; returns the
    pre-trained model's scores on each task kind."""
    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.learning.arms import pretrain_family_a
    from benchmarks.learning.tasks import load_task_data

    torch.set_num_threads(job["threads"])
    hf_logging.disable_progress_bar()
    s, work = job["settings"], Path(job["work"])
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(job["config"], indent=2))
    first = load_task_data(job["data_dirs"][0], str(TOKENIZER), s["max_seq_len"])
    model, loss, t0 = pretrain_family_a(work, s, Path(job["data_dirs"][0]), first.tokenizer, str(TOKENIZER))
    with torch.no_grad():
        scores = {Path(d).name: p2.split_scores(model, load_task_data(d, str(TOKENIZER), s["max_seq_len"]),
                                                None, True) for d in job["data_dirs"]}
    record = {"depth": s["layers"], "steps": s["pretrain_steps"], "train_s": time.perf_counter() - t0,
              "last_loss": loss, "scores": scores}
    (work / "pretrained" / "pretraining.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _pool_map(fn, jobs: list[dict], workers: int):
    if workers <= 1 or len(jobs) <= 1:
        yield from map(fn, jobs)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield from pool.map(fn, jobs)


class Bench:
    def __init__(self, mode: str, out: Path, workers: int, resume: bool):
        self.mode, self.out, self.workers = mode, out, workers
        self.s = p2.SETTINGS[mode]
        self.work = out / "work"
        self.log = self.work / "runs.jsonl"
        self.done: dict[str, dict] = {}
        if resume:  # keep the pre-trained models and every finished run
            for line in self.log.read_text().splitlines() if self.log.is_file() else []:
                rec = json.loads(line)
                self.done[rec["key"]] = rec["run"]
        elif self.work.exists():
            shutil.rmtree(self.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.kinds = sorted({k for st in self.s["stages"] for k in st[2]})
        self.pretrained: dict[int, dict] = {}
        self.notes: list[str] = []
        self.t0 = time.perf_counter()

    def data_dir(self, kind: str) -> Path:
        return self.work / "data" / kind

    def write_data(self) -> None:
        from benchmarks.learning.tasks import write_task_data

        for kind in self.kinds:
            write_task_data(kind, self.data_dir(kind), self.s)

    def pretrain_depths(self, depths: list[int]) -> None:
        todo = []
        for d in dict.fromkeys(depths):
            folder = self.work / f"depth-{d}"
            info = folder / "pretrained" / "pretraining.json"
            if info.is_file():
                self.pretrained[d] = json.loads(info.read_text())
            elif d not in self.pretrained:
                todo.append({"settings": p2.depth_settings(self.s, d), "work": str(folder),
                             "config": self.config(d), "data_dirs": [str(self.data_dir(k)) for k in self.kinds]})
        for job in todo:  # a lone pre-training takes both threads the workers would have had
            job["threads"] = 1 if len(todo) > 1 or self.workers <= 1 else 2
        for rec in _pool_map(pretrain, todo, self.workers):
            self.pretrained[rec["depth"]] = rec
            a = rec["scores"][self.kinds[0]]
            print(f"pre-trained depth {rec['depth']} in {rec['train_s']:.0f} s: A token acc "
                  f"{100 * a['old_token_accuracy']:.1f}, exact match {100 * a['old_exact_match']:.1f}", flush=True)

    def config(self, depth: int) -> dict:
        from transformers import AutoTokenizer

        from scripts import make_quickstart_assets as gen

        dims = p2.depth_settings(self.s, depth)
        cfg = gen.llama_config(len(AutoTokenizer.from_pretrained(str(TOKENIZER))))
        cfg.update(num_hidden_layers=depth, hidden_size=dims["hidden"], intermediate_size=dims["intermediate"])
        return cfg

    def jobs(self, depth: int, kinds: list[str], arms: list[str], lrs: list[float], seeds: list[int],
             steps_x: int) -> list[dict]:
        s = p2.depth_settings(self.s, depth)
        s["steps"] *= steps_x
        cfg = self.config(depth)
        folder = self.work / f"depth-{depth}" / "pretrained"
        return [{"settings": s, "task": kind, "arm": arm, "spec": p2.arm_spec(arm, cfg), "lr": lr, "seed": seed,
                 "pretrained": str(folder), "tokenizer": str(folder), "data_dir": str(self.data_dir(kind)),
                 "threads": 1} for seed in seeds for kind in kinds for arm in arms for lr in lrs]

    def run(self, jobs: list[dict]) -> list[dict]:
        todo = [j for j in jobs if p2.key(j) not in self.done]
        for k, (job, r) in enumerate(zip(todo, _pool_map(p2.run_job, todo, self.workers)), 1):
            self.done[p2.key(job)] = r
            with self.log.open("a") as f:
                f.write(json.dumps({"key": p2.key(job), "run": r}) + "\n")
            fin = r["final"]
            print(f"[{k}/{len(todo)}] d{r['depth']} {r['task']:<10} {r['arm']:<20} lr {r['lr']:<7g} seed {r['seed']} "
                  f"val {100 * fin['val_token_accuracy']:5.1f} test {100 * fin['test_token_accuracy']:5.1f} "
                  f"A {100 * fin['old_token_accuracy']:5.1f}  {r['tokens_per_s']:.0f} tok/s "
                  f"({time.perf_counter() - self.t0:.0f} s)", flush=True)
        return [self.done[p2.key(j)] for j in jobs if p2.key(j) in self.done]

    def stage(self, name: str, depth: int, kinds: list[str], arms: list[str], lrs: list[float],
              sweep: list[int], rerun: list[int], steps_x: int) -> None:
        from benchmarks.learning.report2 import best_lr

        print(f"== stage {name}", flush=True)
        runs = self.run(self.jobs(depth, kinds, arms, lrs, sweep, steps_x))
        picked = {}
        for kind in kinds:
            for arm in arms:
                mine = [r for r in runs if r["task"] == kind and r["arm"] == arm]
                grid = sorted({r["lr"] for r in mine})
                if self.s["extend_edges"] and len(grid) > 1 and best_lr(mine) in (grid[0], grid[-1]):
                    beyond = grid[-1] * 3 if best_lr(mine) == grid[-1] else grid[0] / 3
                    mine += self.run(self.jobs(depth, [kind], [arm], [round(beyond, 10)], sweep, steps_x))
                if mine:
                    picked[(kind, arm)] = best_lr(mine)
        # Every further seed in one batch: one pool of workers, not one per arm.
        self.run([j for (kind, arm), lr in picked.items() for j in self.jobs(depth, [kind], [arm], [lr], rerun,
                                                                              steps_x)])

    def write(self, env: dict) -> None:
        from benchmarks.learning import report2

        summary = report2.summarise(self.mode, self.s, self.pretrained, list(self.done.values()), env)
        summary["wall_s"] = time.perf_counter() - self.t0
        summary["notes"] = self.notes
        report2.write(summary, self.out)


def main(mode: str, out: Path, workers: int, resume: bool, env: dict) -> Bench:
    bench = Bench(mode, out, workers, resume)
    bench.write_data()
    stages = bench.s["stages"]
    for k, (name, depth, kinds, arms, lrs, sweep, rerun, steps_x) in enumerate(stages):
        # The first two stages' models are pre-trained side by side; later ones when reached.
        ahead = [depth] + ([stages[1][1]] if k == 0 and len(stages) > 1 else [])
        bench.pretrain_depths(ahead)
        bench.stage(name, depth, kinds, arms, lrs, sweep, rerun, steps_x)
        bench.write(env)
        print(f"wrote {out} after stage {name} ({time.perf_counter() - bench.t0:.0f} s)", flush=True)
    shutil.rmtree(bench.work / "data", ignore_errors=True)
    return bench
