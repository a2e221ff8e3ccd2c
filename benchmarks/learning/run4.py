"""Runs the fourth protocol's work (benchmarks/learning/protocol4.py) on protocol 3's bench: the
SFT start (once, OUT/work/start-sft/, its scores in OUT/start-sft.json), each start's on-policy
data (once, OUT/work/onpolicy-<start>/, its counts in OUT/onpolicy-<start>.json), and one run at a
time (OUT/runs/NAME.json)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.learning import protocol4 as p4
from benchmarks.learning.run3 import Bench, _write_json, greedy_answers
from scripts import make_smollm2_data as gen


def seed_base(out: Path, settings: dict, theirs: Path = p4.REPO / "benchmarks" / "results" / "learning3-real" /
              "base.json") -> None:
    """Protocol 3's base.json where this one has none and both score alike: the base model's
    answers and scores are the same work."""
    mine = out / "base.json"
    if mine.is_file() or not theirs.is_file():
        return
    base = json.loads(theirs.read_text())
    if all(base["settings"].get(k) == settings[k] for k in p4.SCORING):
        mine.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(theirs, mine)


class Bench4(Bench):
    def __init__(self, model_dir: Path, out: Path, settings: dict):
        seed_base(out, settings)
        super().__init__(model_dir, out, settings)

    def _job(self, name: str, seed: int, lr: float, batch_size: int, max_seq_len: int, steps: int) -> dict:
        s = self.s
        model = str(self.model_dir)
        return {"arm": name, "seed": seed, "lr": lr, "pretrained": model, "tokenizer": model, "threads": s["threads"],
                "settings": {"steps": steps, "batch_size": batch_size, "max_seq_len": max_seq_len,
                             "warmup_steps": s["warmup_steps"], "interval_steps": s["interval_steps"]}}

    def start_dir(self, start: str) -> Path:
        """The start's model folder: the base, or the SFT start (trained once, then kept)."""
        if start == "base":
            return self.model_dir
        folder = self.out / "work" / "start-sft"
        if (folder / "config.json").is_file():
            return folder
        from benchmarks.learning.arms import LisaftArm
        from benchmarks.learning.run3 import _Data

        s = self.s
        job = self._job("sft_start", 0, s["sft_lr"], s["sft_batch_size"], s["max_seq_len"], s["sft_steps"])
        with tempfile.TemporaryDirectory(prefix="sft-", dir=self.work) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = _Data(self.tokenizer, self.train, self.val_examples)
            runner = LisaftArm(job, p4.method_spec("lisa_g4", self.config), data, Path(tmp))
            losses = [runner.step(step)[0] for step in range(s["sft_steps"])]
            record = {"method": "lisa_g4", "lr": s["sft_lr"], "steps": s["sft_steps"], "seed": 0,
                      "train_loss_first": losses[0], "train_loss_last": losses[-1], **self.scores(runner.model)}
            runner.model.save_pretrained(str(folder))
        _write_json(self.out / "start-sft.json", record)
        return folder

    def _start_model(self, start: str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.start_dir(start)), dtype=torch.float32,
                                                    attn_implementation="sdpa")

    def onpolicy_dir(self, start: str) -> Path:
        """The start model's greedy answers to the first pref_prompts train prompts, its wrong ones
        as DPO pairs and KTO rows (written once)."""
        folder = self.out / "work" / f"onpolicy-{start}"
        if (folder / "feedback.jsonl").is_file():
            return folder
        s = self.s
        additions = self.pairs["train"][:s["pref_prompts"]]
        answers = greedy_answers(self._start_model(start), self.tokenizer, [gen.question(a, b) for a, b in additions],
                                 s["answer_tokens"])
        pairs, feedback = p4.onpolicy_rows(additions, answers, s["pref_prompts"])
        folder.mkdir(parents=True, exist_ok=True)
        gen.write_jsonl(folder / "pairs.jsonl", pairs)
        gen.write_jsonl(folder / "feedback.jsonl", feedback)
        _write_json(self.out / f"onpolicy-{start}.json",
                    {"start": start, "prompts": len(additions), "pairs": len(pairs),
                     "exact": sum(ans == str(a + b) for ans, (a, b) in zip(answers, additions)) / len(additions),
                     "examples": [p["rejected"][0]["content"] for p in pairs[:4]]})
        return folder

    def _train_examples(self, objective: str, start: str) -> tuple[str, list]:
        """(data format, tokenized train examples) of an objective from a start."""
        from lisaft.config.schema import DataSection
        from lisaft.data.examples import load_splits

        s = self.s
        if objective == "grpo":
            path, fmt, max_seq_len = self.work / "prompts.jsonl", "prompts", s["max_seq_len"]
            gen.write_jsonl(path, [gen.prompt_row(a, b) for a, b in self.pairs["train"]])
        else:
            fmt = "preference" if objective == "dpo" else "feedback"
            path = self.onpolicy_dir(start) / ("pairs.jsonl" if objective == "dpo" else "feedback.jsonl")
            max_seq_len = s["pref_max_seq_len"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fmt, load_splits(DataSection(train=str(path), format=fmt, max_seq_len=max_seq_len),
                                    self.tokenizer, 0)[0]

    def _recipe(self, objective: str, start: str, spec: dict, lr: float, seed: int, run_dir: Path):
        from benchmarks.learning.arms import lisaft_recipe

        s = self.s
        if objective == "grpo":
            job = self._job(objective, seed, lr, s["grpo_batch_size"], s["max_seq_len"], s["grpo_steps"])
            section = {"reward_funcs": [s["grpo_reward"]], "num_generations": s["num_generations"],
                       "max_completion_length": s["max_completion_length"], "temperature": s["temperature"]}
            return lisaft_recipe(job, spec, {"name_or_path": str(self.start_dir(start))}, run_dir,
                                 s["grpo_steps"], lr, grpo=section), s["grpo_steps"]
        job = self._job(objective, seed, lr, s["pref_batch_size"], s["pref_max_seq_len"], s["pref_steps"])
        return lisaft_recipe(job, spec, {"name_or_path": str(self.start_dir(start))}, run_dir, s["pref_steps"], lr,
                             preference={"loss": objective, "beta": s["beta"]}), s["pref_steps"]

    def run_objective(self, objective: str, start: str, method: str, spec: dict, lr: float, seed: int) -> dict:
        from benchmarks.learning.measure import peak_rss_bytes, reset_peak_rss
        from lisaft.train import build_session, train_step

        _, train = self._train_examples(objective, start)
        reset_peak_rss()
        with tempfile.TemporaryDirectory(prefix="run-", dir=self.work) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recipe, steps = self._recipe(objective, start, spec, lr, seed, Path(tmp))
            t0 = time.perf_counter()
            session = build_session(recipe, Path(tmp), tokenizer=self.tokenizer, train_examples=train,
                                    eval_examples=None)
            losses, rewards, zero_std, state = [], [], [], 0
            for step in range(steps):
                result = train_step(session, step)
                losses.append(result.loss)
                rewards.append(result.figures.get("reward"))
                zero_std.append(result.figures.get("frac_reward_zero_std"))
                state = max(state, sum(session.optimizers.state_bytes()))
            train_s = time.perf_counter() - t0
            record = {"objective": objective, "start": start, "method": method, "arm": method, "lr": lr,
                      "seed": seed, "spec": spec, "train_examples": len(train), "steps": steps, "train_s": train_s,
                      "train_loss_first": losses[0], "train_loss_last": losses[-1],
                      "trainable_params_last": session.controller.trainable_params(),
                      "optimizer_state_bytes": state, **self.scores(session.model),
                      "peak_rss_bytes": peak_rss_bytes(), "threads": torch.get_num_threads(),
                      "load_avg_1min": round(os.getloadavg()[0], 2)}
            if objective == "grpo":
                record.update(rewards=rewards, frac_reward_zero_std=zero_std, reward_func=self.s["grpo_reward"],
                              batch_size=self.s["grpo_batch_size"], num_generations=self.s["num_generations"])
        _write_json(self.out / "runs" / f"{p4.run_name(objective, start, method, lr, seed)}.json", record)
        return record
