"""Runs the third protocol's work (benchmarks/learning/protocol3.py): the data, the base model's
scores and answers (once, OUT/base.json), and one arm's run at a time (OUT/runs/NAME.json)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.learning.protocol3 import SPLITS, last_number, run_name
from scripts import make_smollm2_data as gen


def _write_json(path: Path, record: dict) -> None:
    """Whole or not at all: a run killed mid-write leaves no file, so it runs again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch: int = 48) -> list[str]:
    """Greedy answers to single-turn chat prompts, cut at end of turn. Prompts of one token length
    batch together unpadded, so a batched answer is the one-by-one answer."""
    from lisaft.data.formats.chat import chat_prompt_ids

    was_training = model.training
    model.eval()
    ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}], "protocol 3") for p in prompts]
    eos = tokenizer.eos_token_id
    answers: list[str] = [""] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        by_len.setdefault(len(x), []).append(i)
    for group in by_len.values():
        for lo in range(0, len(group), batch):
            idx = group[lo:lo + batch]
            x = torch.tensor([ids[i] for i in idx], dtype=torch.long)
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=eos)
            for i, row in zip(idx, out[:, x.shape[1]:].tolist()):
                row = row[:row.index(eos)] if eos in row else row
                answers[i] = tokenizer.decode(row, skip_special_tokens=True).strip()
    model.train(was_training)
    return answers


def is_exact(answer: str, total: str) -> bool:
    """The held-out score's test: the answer up to end of turn is the sum and nothing else but
    surrounding whitespace (protocol 4's GRPO reward is this same test)."""
    return answer.strip() == total


def addition_scores(model, tokenizer, pairs: list[tuple[int, int]], max_new_tokens: int) -> dict:
    answers = greedy_answers(model, tokenizer, [gen.question(a, b) for a, b in pairs], max_new_tokens)
    exact = sum(is_exact(ans, str(a + b)) for ans, (a, b) in zip(answers, pairs))
    lenient = sum(last_number(ans) == a + b for ans, (a, b) in zip(answers, pairs))
    return {"exact": exact / len(pairs), "lenient": lenient / len(pairs), "examples": answers[:6]}


class Bench:
    def __init__(self, model_dir: Path, out: Path, settings: dict):
        from transformers import AutoConfig

        from lisaft.config.schema import ModelSection
        from lisaft.model.load import load_tokenizer

        torch.set_num_threads(settings["threads"])
        self.model_dir, self.out, self.s = model_dir, out, settings
        self.config = AutoConfig.from_pretrained(str(model_dir)).to_dict()
        self.tokenizer = load_tokenizer(ModelSection(name_or_path=str(model_dir)))
        self.pairs = gen.splits(SPLITS)
        self.work = Path(tempfile.mkdtemp(prefix="learning3-"))
        self.train = self._chat_examples("train", [gen.chat_row(a, b) for a, b in self.pairs["train"]],
                                         settings["max_seq_len"])
        self.val_examples = self._chat_examples("val", [gen.chat_row(a, b) for a, b in self.pairs["val"]],
                                                settings["max_seq_len"])
        self.base = self._base()
        self.instruction_examples = self._instruction_examples(self.base["instruction_answers"])

    def _chat_examples(self, name: str, rows: list[dict], max_seq_len: int) -> list:
        from lisaft.config.schema import DataSection
        from lisaft.data.examples import load_splits

        path = self.work / f"{name}.jsonl"
        gen.write_jsonl(path, rows)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_splits(DataSection(train=str(path), format="chat", max_seq_len=max_seq_len),
                               self.tokenizer, 0)[0]

    def _instruction_examples(self, answers: list[str]) -> list:
        """The instructions with the base model's answers (empty ones left out), as chat examples
        whose loss is on the answer: a long enough max_seq_len that none is cut."""
        rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                for q, a in zip(gen.instructions(), answers) if a]
        return self._chat_examples("instructions", rows, 160)

    def _load_model(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32,
                                                    attn_implementation="sdpa")

    def _base(self) -> dict:
        """The base model's answers to the instructions, the facts it gets right, and its scores:
        computed once and kept in OUT/base.json (every run is measured against them)."""
        path = self.out / "base.json"
        if path.is_file():
            return json.loads(path.read_text())
        model = self._load_model()
        s = self.s
        facts = greedy_answers(model, self.tokenizer, [q for q, _ in gen.FACTS], s["fact_tokens"])
        kept = [[q, w] for (q, w), ans in zip(gen.FACTS, facts) if gen.fact_right(ans, w)]
        record = {"model": self.model_dir.name, "settings": s,
                  "instruction_answers": greedy_answers(model, self.tokenizer, gen.instructions(),
                                                        s["instruction_tokens"]),
                  "facts_kept": kept, "facts_candidates": len(gen.FACTS),
                  "val": addition_scores(model, self.tokenizer, self.pairs["val"], s["answer_tokens"]),
                  "test": addition_scores(model, self.tokenizer, self.pairs["test"], s["answer_tokens"])}
        self.instruction_examples = self._instruction_examples(record["instruction_answers"])
        record["instructions_nll"] = self._instructions_nll(model)
        _write_json(path, record)
        return record

    def _instructions_nll(self, model) -> float:
        """Mean NLL per answer token of the base model's answers (forgetting measure a)."""
        from benchmarks.learning.measure import token_accuracy

        return token_accuracy(model, self.instruction_examples, self.tokenizer.pad_token_id)["loss"]

    def scores(self, model) -> dict:
        from benchmarks.learning.measure import token_accuracy

        s, tok = self.s, self.tokenizer
        val = addition_scores(model, tok, self.pairs["val"], s["answer_tokens"])
        val["nll"] = token_accuracy(model, self.val_examples, tok.pad_token_id)["loss"]
        facts = greedy_answers(model, tok, [q for q, _ in self.base["facts_kept"]], s["fact_tokens"])
        right = sum(gen.fact_right(a, w) for a, (_, w) in zip(facts, self.base["facts_kept"]))
        return {"val": val, "test": addition_scores(model, tok, self.pairs["test"], s["answer_tokens"]),
                "instructions_nll": self._instructions_nll(model),
                "facts": right / max(len(facts), 1)}

    def run(self, arm: str, spec: dict, lr: float, seed: int) -> dict:
        from benchmarks.learning.arms import LisaftArm
        from benchmarks.learning.measure import peak_rss_bytes, reset_peak_rss

        s = self.s
        job = {"arm": arm, "seed": seed, "lr": lr, "pretrained": str(self.model_dir), "tokenizer": str(self.model_dir),
               "settings": {k: s[k] for k in ("steps", "batch_size", "max_seq_len", "warmup_steps", "interval_steps")}}
        data = _Data(self.tokenizer, self.train, self.val_examples)
        reset_peak_rss()
        with tempfile.TemporaryDirectory(prefix="run-", dir=self.work) as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = LisaftArm(job, spec, data, Path(tmp))
            losses, train_s = [], 0.0
            for step in range(s["steps"]):
                t0 = time.perf_counter()
                losses.append(runner.step(step)[0])
                train_s += time.perf_counter() - t0
            record = {"arm": arm, "lr": lr, "seed": seed, "spec": spec, "train_s": train_s,
                      "train_loss_first": losses[0], "train_loss_last": losses[-1],
                      "trainable_params_last": runner.trainable_params(), **runner.memory(),
                      **self.scores(runner.model), "peak_rss_bytes": peak_rss_bytes(),
                      "threads": torch.get_num_threads(), "load_avg_1min": round(os.getloadavg()[0], 2)}
        _write_json(self.out / "runs" / f"{run_name(arm, lr, seed)}.json", record)
        return record


class _Data:
    """What benchmarks.learning.arms.LisaftArm reads: the tokenizer and the tokenized splits."""

    def __init__(self, tokenizer, new_train: list, new_eval: list):
        self.tokenizer, self.new_train, self.new_eval = tokenizer, new_train, new_eval

