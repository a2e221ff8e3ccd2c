"""The learning benchmark's preference protocol: does DPO, SimPO or ORPO teach a model to prefer a
task's right answer, and to give it, with each method at equal optimizer memory?

    python -m benchmarks.learning_bench --protocol 2 --preference           # what ran (docs/learning.md)
    python -m benchmarks.learning_bench --protocol 2 --preference --quick   # tiny: a smoke of every arm

The model is protocol 2's smallest, its --quick depth: 4 decoder layers x 64, pre-trained on
task family A (Reverse, Uppercase, Sort) with protocol 2's pre-training settings for 200 steps
instead of 500, so that it answers some held-out items right and some wrong (on the shared
2-core machine a 6-layer pre-training alone did not fit the time this ran in: docs/learning.md).
Pairs are family A's rows: `chosen` the right answer, `rejected` a plausible wrong one
(`wrong_answer`). Train pairs are the pre-training inputs, eval pairs A's held-out inputs. Each
arm (full, LISA γ=2, LoRA at LISA γ=2's optimizer state, APOLLO-Mini; the arms and lrs of
protocol 2, `--lr-scale` times them) trains with each loss through lisaft's own loop, and is
scored before and after on the held-out pairs: the loss's own implicit reward accuracy, the
summed log-prob accuracy (chosen more likely than rejected, the same measure for every loss),
and the exact match of the greedy answer to the prompt. Each finished run is appended to
OUT/work/runs.jsonl and OUT/learning-pref.json and .md are rewritten, so a killed run keeps
what it measured and `--resume` runs only the rest.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from benchmarks.learning import protocol2 as p2

LOSSES = ("dpo", "simpo", "orpo")
ARMS = ("full", "lisa_g2_uniform", "lora_eq_g2", "apollo_mini")
# Each arm's lr: protocol 2's pick at depth 6 (its smallest swept depth) on the new skill, APOLLO mode.
LR_SOURCE = ("benchmarks/results/learning2-apollo/learning2.json", "results", "new_skill", "6")
# Protocol 2's settings (the pre-training's batch, lr and warm-up among them), fewer steps and pairs.
BASE_SETTINGS = dict({k: v for k, v in p2.SETTINGS["reduced"].items() if k not in ("stages", "extend_edges")},
             pretrain_steps=200, batch_size=8, max_seq_len=64, warmup_steps=3, interval_steps=10)
SETTINGS = {
    "run": dict(BASE_SETTINGS, depth=4, steps=20, train_pairs=160, eval_pairs=100, seeds=[0, 1, 2],
                grid=[(loss, arm) for loss in LOSSES for arm in ARMS]),
    "quick": dict(BASE_SETTINGS, depth=4, pretrain_steps=60, pretrain_warmup_steps=6, steps=4, batch_size=8,
                  interval_steps=2, warmup_steps=1, train_pairs=32, eval_pairs=16, seeds=[0],
                  grid=[(loss, arm) for loss in LOSSES for arm in ARMS]),
}


def wrong_answer(row: dict, rng: random.Random, neighbour: dict) -> tuple[str, str]:
    """A plausible wrong answer to an instruction row of family A and how it was made: another
    family-A task's answer to the same input, the neighbouring item's answer to the same task,
    or the right answer with one letter changed (in turn, by `rng`; always differs from it)."""
    from scripts import make_quickstart_assets as gen

    right = row["output"]
    kind = rng.choice(("other_task", "neighbour", "one_letter"))
    if kind == "other_task":
        others = [fn(row["input"]) for name, fn in gen.TASKS.items() if name != row["instruction"]]
        wrong = rng.choice([o for o in others if o != right] or [right])
    elif kind == "neighbour":
        wrong = gen.TASKS[row["instruction"]](neighbour["input"])
    else:
        wrong = right
    if wrong == right:
        kind, i = "one_letter", rng.randrange(len(right))
        letter = rng.choice([c for c in gen.LETTERS if c != right[i].lower()])
        wrong = right[:i] + (letter.upper() if right[i].isupper() else letter) + right[i + 1:]
    return wrong, kind


def pair_rows(rows: list[dict], seed: int) -> list[dict]:
    """Preference rows (prompt, chosen, rejected) from instruction rows, the prompt rendered as the
    instruction format renders it, so that `chosen` is exactly the instruction example."""
    from lisaft.data.formats.instruction import render_instruction_prompt

    rng = random.Random(seed)
    out = []
    for i, row in enumerate(rows):
        same_task = [r for r in rows[i + 1:] + rows[:i] if r["instruction"] == row["instruction"]]
        wrong, kind = wrong_answer(row, rng, same_task[0] if same_task else row)
        out.append({"prompt": render_instruction_prompt(row["instruction"], row["input"]), "chosen": row["output"],
                    "rejected": wrong, "wrong_kind": kind})
    return out


def write_pairs(data_dir: Path, s: dict) -> None:
    """A_train (pre-training), pairs_train (on pre-training inputs) and pairs_eval (held-out inputs)."""
    from scripts import make_quickstart_assets as gen

    data_dir.mkdir(parents=True, exist_ok=True)
    a_train, a_eval = gen.make_rows(random.Random(gen.SEED))
    gen.write_jsonl(data_dir / "A_train.jsonl", a_train)
    gen.write_jsonl(data_dir / "pairs_train.jsonl", pair_rows(a_train[:s["train_pairs"]], gen.SEED + 10))
    gen.write_jsonl(data_dir / "pairs_eval.jsonl", pair_rows(a_eval[:s["eval_pairs"]], gen.SEED + 11))


def picked_lrs(repo: Path) -> dict[str, float]:
    path, *keys = LR_SOURCE
    node = json.loads((repo / path).read_text())
    for k in keys:
        node = node[k]
    return {arm: node[arm]["best_lr"] for arm in ARMS}


_PAIRS: dict[str, tuple] = {}


def load_pairs(data_dir: str, tokenizer_dir: str, max_seq_len: int) -> tuple:
    """(tokenizer, train pairs, eval pairs), read once per process."""
    if data_dir not in _PAIRS:
        from lisaft.config.schema import DataSection, ModelSection
        from lisaft.data.examples import load_splits
        from lisaft.model.load import load_tokenizer

        tok = load_tokenizer(ModelSection(config="unused", tokenizer=tokenizer_dir))
        d = Path(data_dir)
        sec = DataSection(train=str(d / "pairs_train.jsonl"), eval=str(d / "pairs_eval.jsonl"), format="preference",
                          max_seq_len=max_seq_len)
        train, evals = load_splits(sec, tok, 0)
        _PAIRS[data_dir] = (tok, train, evals)
    return _PAIRS[data_dir]


def pair_scores(model, pairs: list[dict], tokenizer, objective=None) -> dict:
    """Held-out scores: logp_accuracy (summed log-prob of chosen above rejected's), exact_match of
    the greedy answer, and with an objective its reward_accuracy, reward_margin and eval_loss."""
    import torch

    from benchmarks.learning.measure import exact_match
    from lisaft.data.order import eval_index_batches
    from lisaft.model.preference import collate_pairs, sequence_logps
    from lisaft.train.objectives.pairs import evaluate_pairs

    was_training = model.training
    model.eval()
    batches = eval_index_batches(len(pairs), 32)
    above = 0
    with torch.no_grad():
        for idx in batches:
            logps = sequence_logps(model, collate_pairs([pairs[i] for i in idx], tokenizer.pad_token_id))[0]
            above += int((logps[:len(idx)] > logps[len(idx):]).sum())
    out = {"logp_accuracy": above / len(pairs),
           "exact_match": exact_match(model, [p["chosen"] for p in pairs], tokenizer.pad_token_id,
                                      tokenizer.eos_token_id)}
    if objective is not None:
        got = evaluate_pairs(objective, model, pairs, batches, len(batches), tokenizer.pad_token_id,
                             torch.device("cpu"))
        out.update(reward_accuracy=got["eval_reward_accuracy"], reward_margin=got["eval_reward_margin"],
                   eval_loss=got["eval_loss"])
    model.train(was_training)
    return out


def run_job(job: dict) -> dict:
    """One arm, loss and seed: train, then score the held-out pairs."""
    import tempfile
    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    from benchmarks.learning.arms import lisaft_recipe
    from lisaft.train import build_session, train_step

    torch.set_num_threads(job["threads"])
    hf_logging.disable_progress_bar()
    s = job["settings"]
    tok, train, evals = load_pairs(job["data_dir"], job["tokenizer"], s["max_seq_len"])
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="learning-pref-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe = lisaft_recipe(job, job["spec"], {"name_or_path": job["pretrained"]}, Path(tmp), s["steps"],
                               job["lr"], preference={"loss": job["loss"]})
        session = build_session(recipe, Path(tmp), tokenizer=tok, train_examples=train, eval_examples=evals)
        ready_s = time.perf_counter() - t0
        losses, state = [], 0
        for step in range(s["steps"]):
            losses.append(train_step(session, step).loss)
            resident, offloaded = session.optimizers.state_bytes()
            state = max(state, resident + offloaded)
        train_s = time.perf_counter() - t0 - ready_s
        after = pair_scores(session.model, evals, tok, session.objective.loss)
    return {"loss": job["loss"], "arm": job["arm"], "lr": job["lr"], "seed": job["seed"], "steps": s["steps"],
            "train_loss_first": losses[0], "train_loss_last": losses[-1], "setup_s": ready_s, "train_s": train_s,
            "wall_s": time.perf_counter() - t0, "peak_optimizer_state_bytes": state,
            "trainable_params_last": session.controller.trainable_params(),
            "lora_rank": job["spec"].get("lora", {}).get("rank"), "after": after}


def key(job: dict) -> str:
    return json.dumps([job["loss"], job["arm"], job["lr"], job["seed"], job["settings"]], sort_keys=True)


def before_scores(pretrained: str, data_dir: str, s: dict) -> dict:
    """The pre-trained model's held-out scores; its reward accuracy under SimPO's and ORPO's own
    rewards (DPO's is undefined there: the policy is the reference, every margin 0)."""
    from transformers import AutoModelForCausalLM

    from lisaft.config.schema import PreferenceSection
    from lisaft.model.preference import PairObjective

    tok, _, evals = load_pairs(data_dir, pretrained, s["max_seq_len"])
    model = AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation="sdpa")
    out = pair_scores(model, evals, tok)
    for loss in ("simpo", "orpo"):
        out[f"{loss}_reward_accuracy"] = pair_scores(model, evals, tok, PairObjective(
            PreferenceSection(loss=loss)))["reward_accuracy"]
    return out


def pretrain(work: Path, s: dict, tokenizer_dir: str) -> dict:
    """Protocol 2's pre-training of family A at this depth, or the one an earlier run left in
    work/pretrained (pre-training is deterministic on CPU)."""
    from benchmarks.learning.arms import pretrain_family_a
    from benchmarks.learning.run2 import Bench
    from lisaft.config.schema import ModelSection
    from lisaft.model.load import load_tokenizer

    info = work / "pretrained" / "pretraining.json"
    if info.is_file() and json.loads(info.read_text())["steps"] == s["pretrain_steps"]:
        return {**json.loads(info.read_text()), "reused_from_earlier_run": True}
    bench = Bench.__new__(Bench)  # only its model config
    bench.s = {"stages": []}
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(bench.config(s["layers"]), indent=2))
    tok = load_tokenizer(ModelSection(config="unused", tokenizer=tokenizer_dir))
    _, loss, started = pretrain_family_a(work, s, work.parent / "data", tok, tokenizer_dir, log_every=50)
    record = {"depth": s["layers"], "steps": s["pretrain_steps"], "train_s": time.perf_counter() - started,
              "last_loss": loss}
    info.write_text(json.dumps(record, indent=1) + "\n")
    return record


def jobs(s: dict, work: Path, lrs: dict[str, float], cfg: dict) -> list[dict]:
    """DPO's runs first, every seed (the core), then SimPO's and ORPO's, seed by seed."""
    folder = str(work / f"depth-{s['layers']}" / "pretrained")
    grid = sorted(((loss, arm, seed) for loss, arm in s["grid"] for seed in s["seeds"]),
                  key=lambda j: (j[0] != "dpo", j[2], LOSSES.index(j[0]), ARMS.index(j[1])))
    return [{"settings": s, "loss": loss, "arm": arm, "seed": seed, "lr": lrs[arm], "spec": p2.arm_spec(arm, cfg),
             "pretrained": folder, "tokenizer": folder, "data_dir": str(work / "data"), "threads": 1}
            for loss, arm, seed in grid]


def main(mode: str, out: Path, workers: int, resume: bool, env: dict, repo: Path, lr_scale: float = 1.0) -> dict:
    from benchmarks.learning import report_pref
    from benchmarks.learning.run2 import TOKENIZER, _pool_map

    t0 = time.perf_counter()
    s = {**p2.depth_settings(SETTINGS[mode], SETTINGS[mode]["depth"]), "lr_scale": lr_scale}
    work = out / "work"
    log = work / "runs.jsonl"
    done = {}
    if resume and log.is_file():
        done = {rec["key"]: rec["run"] for rec in map(json.loads, log.read_text().splitlines())}
    elif log.exists():
        log.unlink()
    write_pairs(work / "data", s)
    depth_dir = work / f"depth-{s['layers']}"
    pre = pretrain(depth_dir, s, str(TOKENIZER))
    pre["before"] = before_scores(str(depth_dir / "pretrained"), str(work / "data"), s)
    print(f"pre-trained {pre['steps']} steps: held-out greedy exact match {100 * pre['before']['exact_match']:.1f}, "
          f"log-prob accuracy {100 * pre['before']['logp_accuracy']:.1f}", flush=True)
    lrs = {arm: lr * lr_scale for arm, lr in picked_lrs(repo).items()}
    from benchmarks.learning.run2 import Bench

    bench = Bench.__new__(Bench)
    bench.s = {"stages": []}
    todo = [j for j in jobs(s, work, lrs, bench.config(s["layers"])) if key(j) not in done]

    def write() -> dict:
        summary = report_pref.summarise(mode, s, pre, list(done.values()), lrs, env)
        summary["wall_s"] = time.perf_counter() - t0
        report_pref.write(summary, out)
        return summary

    summary = write()
    for k, (job, r) in enumerate(zip(todo, _pool_map(run_job, todo, workers)), 1):
        done[key(job)] = r
        with log.open("a") as f:
            f.write(json.dumps({"key": key(job), "run": r}) + "\n")
        a = r["after"]
        print(f"[{k}/{len(todo)}] {r['loss']:<5} {r['arm']:<16} lr {r['lr']:<6g} seed {r['seed']}  reward acc "
              f"{100 * a['reward_accuracy']:5.1f}  logp acc {100 * a['logp_accuracy']:5.1f}  EM "
              f"{100 * a['exact_match']:5.1f}  {r['wall_s']:.0f} s ({time.perf_counter() - t0:.0f} s)", flush=True)
        summary = write()
    return summary
