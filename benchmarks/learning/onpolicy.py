"""The learning benchmark's on-policy preference protocol: do DPO and KTO make the model answer
more held-out prompts right when the rejected answer is the model's own mistake?

    python -m benchmarks.learning_bench --protocol 2 --onpolicy           # the protocol (docs/learning.md)
    python -m benchmarks.learning_bench --protocol 2 --onpolicy --quick   # tiny: a smoke of every arm

The first preference protocol (benchmarks/learning/preference.py) could not show it: its
rejected answers were made up, and the pre-trained model already ranked 99% of the held-out pairs
right. Here the model is the same (protocol 2's quick depth, pre-trained on family A for 200
steps), and its greedy answer to each family-A train prompt is generated; the prompts it answers
wrong make the data: DPO's pairs (`chosen` the right answer, `rejected` the model's own wrong
one) and KTO's rows (the same answers labelled: the right one desirable, the own wrong one
undesirable). Only train prompts are used, so the held-out prompts stay unseen. Each arm (full,
LISA γ=2, LoRA at LISA γ=2's optimizer state, APOLLO-Mini: equal optimizer memory, as the first
preference protocol) trains with each loss at LR_FACTORS times its protocol 2 SFT lr, every seed.
The held-out items are split in two: the validation half picks each (loss, arm)'s lr by mean
greedy exact match, the test half reports it, before and after. Each finished run is appended
to OUT/work/runs.jsonl and OUT/learning-onpolicy.json and .md are rewritten, so a killed run keeps
what it measured and `--resume` runs only the rest.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.learning import preference as pref
from benchmarks.learning import protocol2 as p2

LOSSES = ("dpo", "kto")
ARMS = pref.ARMS
# Times each arm's SFT lr: the first protocol found lr / 10 right for DPO; here the grid's low edge
# won at 0.03, so it reaches down to 0.003.
LR_FACTORS = (0.003, 0.01, 0.03, 0.1, 0.3)
SETTINGS = {
    "run": dict(pref.BASE_SETTINGS, depth=4, steps=20, train_pairs=160, eval_items=200, seeds=[0, 1, 2],
                lr_factors=LR_FACTORS),
    "quick": dict(pref.BASE_SETTINGS, depth=4, pretrain_steps=60, pretrain_warmup_steps=6, steps=4, interval_steps=2,
                  warmup_steps=1, train_pairs=32, eval_items=16, seeds=[0], lr_factors=(0.1,)),
}


@torch.no_grad()
def greedy(model, prompts: list[list[int]], max_new: int, pad_id: int, eos_id: int) -> list[list[int]]:
    """Each prompt's greedy answer up to (not including) EOS; prompts of one length batch together
    without padding, as benchmarks/learning/measure.py exact_match does."""
    model.eval()
    out: list[list[int]] = [[] for _ in prompts]
    by_len = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for _, group in itertools.groupby(by_len, key=lambda i: len(prompts[i])):
        idx = list(group)
        ids = torch.tensor([prompts[i] for i in idx], dtype=torch.long)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, num_beams=1, eos_token_id=eos_id, pad_token_id=pad_id)
        for i, answer in zip(idx, gen[:, ids.shape[1]:].tolist()):
            out[i] = answer[:answer.index(eos_id)] if eos_id in answer else answer
    return out


def _instruction(path: Path, tok, max_seq_len: int) -> list[dict]:
    from lisaft.config.schema import DataSection
    from lisaft.data.examples import load_splits

    return load_splits(DataSection(train=str(path), format="instruction", max_seq_len=max_seq_len), tok, 0)[0]


def own_mistakes(pretrained: str, data_dir: Path, s: dict) -> dict:
    """The pre-trained model's greedy answers to the train prompts; the wrong ones written as DPO's
    pairs and KTO's rows (train_pairs of them at most), and the figures before training."""
    from transformers import AutoModelForCausalLM

    from lisaft.data.formats.instruction import render_instruction_prompt
    from lisaft.model.preference import collate_pairs, sequence_logps

    tok = _tokenizer(pretrained)
    rows = [json.loads(line) for line in (data_dir / "A_train.jsonl").read_text().splitlines()]
    examples = _instruction(data_dir / "A_train.jsonl", tok, s["max_seq_len"])
    model = AutoModelForCausalLM.from_pretrained(pretrained, attn_implementation="sdpa")
    prompts = [ex["input_ids"][:ex["labels"].index(next(x for x in ex["labels"] if x != -100))] for ex in examples]
    answers = greedy(model, prompts, 24, tok.pad_token_id, tok.eos_token_id)
    pairs = []
    for row, answer in zip(rows, answers):
        own = tok.decode(answer, skip_special_tokens=True).strip()
        if own and own != row["output"] and len(pairs) < s["train_pairs"]:
            pairs.append({"prompt": render_instruction_prompt(row["instruction"], row["input"]),
                          "chosen": row["output"], "rejected": own})
    feedback = [{"prompt": p["prompt"], "completion": c, "label": good}
                for p in pairs for c, good in ((p["chosen"], True), (p["rejected"], False))]
    for name, lines in (("pairs_train", pairs), ("feedback_train", feedback)):
        (data_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    # How often the model prefers its own mistake: the summed log-prob of rejected above chosen's.
    train = _splits(str(data_dir), pretrained, s["max_seq_len"], "preference")[1]
    batch = collate_pairs(train, tok.pad_token_id)
    logps = sequence_logps(model, batch)[0].view(2, -1)
    wrong = sum(1 for row, a in zip(rows, answers) if tok.decode(a, skip_special_tokens=True).strip() != row["output"])
    return {"train_prompts": len(rows), "train_prompts_answered_wrong": wrong, "pairs": len(pairs),
            "prefers_own_mistake": float((logps[1] > logps[0]).float().mean())}


def _tokenizer(folder: str):
    from lisaft.config.schema import ModelSection
    from lisaft.model.load import load_tokenizer

    return load_tokenizer(ModelSection(config="unused", tokenizer=folder))


_DATA: dict[tuple, tuple] = {}


def _splits(data_dir: str, tokenizer_dir: str, max_seq_len: int, fmt: str) -> tuple:
    """(tokenizer, train examples of `fmt`, validation and test instruction examples), once per process."""
    key = (data_dir, fmt)
    if key not in _DATA:
        from lisaft.config.schema import DataSection
        from lisaft.data.examples import load_splits

        tok = _tokenizer(tokenizer_dir)
        name = "pairs_train" if fmt == "preference" else "feedback_train"
        train = load_splits(DataSection(train=f"{data_dir}/{name}.jsonl", format=fmt, max_seq_len=max_seq_len),
                            tok, 0)[0]
        held = _instruction(Path(data_dir) / "A_heldout.jsonl", tok, max_seq_len)
        _DATA[key] = (tok, train, held[: len(held) // 2], held[len(held) // 2:])
    return _DATA[key]


def run_job(job: dict) -> dict:
    """One loss, arm, lr and seed: train, then the held-out greedy exact match (validation and test)."""
    import tempfile
    import warnings

    from transformers.utils import logging as hf_logging

    from benchmarks.learning.arms import lisaft_recipe
    from benchmarks.learning.measure import exact_match
    from lisaft.train import build_session, train_step

    torch.set_num_threads(job["threads"])
    hf_logging.disable_progress_bar()
    s = job["settings"]
    fmt = "preference" if job["loss"] == "dpo" else "feedback"
    tok, train, val, test = _splits(job["data_dir"], job["tokenizer"], s["max_seq_len"], fmt)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="learning-onpolicy-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe = lisaft_recipe(job, job["spec"], {"name_or_path": job["pretrained"]}, Path(tmp), s["steps"],
                               job["lr"], preference={"loss": job["loss"]})
        session = build_session(recipe, Path(tmp), tokenizer=tok, train_examples=train, eval_examples=None)
        state, losses = 0, []
        for step in range(s["steps"]):
            losses.append(train_step(session, step).loss)
            state = max(state, sum(session.optimizers.state_bytes()))
        scores = {name: exact_match(session.model, part, tok.pad_token_id, tok.eos_token_id)
                  for name, part in (("validation", val), ("test", test))}
    return {"loss": job["loss"], "arm": job["arm"], "lr": job["lr"], "lr_factor": job["lr_factor"],
            "seed": job["seed"], "train_loss_first": losses[0], "train_loss_last": losses[-1],
            "peak_optimizer_state_bytes": state, "wall_s": time.perf_counter() - t0, "after": scores}


def key(job: dict) -> str:
    # Not the lr grid: a run with more lrs keeps (--resume) the runs of the lrs it shares.
    settings = {k: v for k, v in job["settings"].items() if k != "lr_factors"}
    return json.dumps([job["loss"], job["arm"], job["lr"], job["seed"], settings], sort_keys=True)


def _mean_sd(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarise(mode: str, s: dict, before: dict, runs: list[dict], env: dict) -> dict:
    """Per (loss, arm): every lr's validation and test exact match over seeds, the lr validation
    picks, and its test gain over the pre-trained model."""
    cells: dict[str, dict] = {}
    for loss, arm in itertools.product(LOSSES, ARMS):
        mine = [r for r in runs if r["loss"] == loss and r["arm"] == arm]
        by_lr = {lr: [r for r in mine if r["lr"] == lr] for lr in sorted({r["lr"] for r in mine})}
        if not by_lr:
            continue
        lrs = {str(lr): {part: _mean_sd([r["after"][part] for r in rs]) for part in ("validation", "test")}
               for lr, rs in by_lr.items()}
        best = max(by_lr, key=lambda lr: lrs[str(lr)]["validation"]["mean"])
        gains = [r["after"]["test"] - before["test"] for r in by_lr[best]]
        cells.setdefault(loss, {})[arm] = {
            "lrs": lrs, "picked_lr": best, "test": lrs[str(best)]["test"], "test_gain": _mean_sd(gains),
            "raised_in_every_seed": all(g > 0 for g in gains),
            "peak_optimizer_state_bytes": max(r["peak_optimizer_state_bytes"] for r in mine)}
    planned = len(LOSSES) * len(ARMS) * len(s["lr_factors"]) * len(s["seeds"])
    return {"benchmark": "learning", "protocol": "onpolicy-preference", "mode": mode, "settings": s,
            "environment": env, "before": before, "results": cells, "runs_done": len(runs),
            "runs_planned": planned, "runs": runs}


def render(summary: dict) -> str:
    b = summary["before"]
    lines = [f"# On-policy preference protocol ({summary['mode']})", "",
             f"Pre-trained: greedy exact match {100 * b['test']:.1f}% on the test half "
             f"({100 * b['validation']:.1f}% validation); wrong on {b['train_prompts_answered_wrong']} of "
             f"{b['train_prompts']} train prompts, {b['pairs']} pairs made; the model's summed log-prob prefers "
             f"its own wrong answer on {100 * b['prefers_own_mistake']:.1f}% of them.", "",
             "| loss | method | lr (picked on validation) | test exact match % | gain (points) | optimizer state |",
             "|---|---|---|---|---|---|"]
    for loss, arms in summary["results"].items():
        for arm, c in arms.items():
            t, g = c["test"], c["test_gain"]
            lines.append(f"| {loss} | {arm} | {c['picked_lr']:g} | {100 * t['mean']:.1f} ± {100 * t['sd']:.1f} | "
                         f"{100 * g['mean']:+.1f} ± {100 * g['sd']:.1f} | "
                         f"{c['peak_optimizer_state_bytes'] / 2**20:.2f} MiB |")
    lines += ["", f"{summary['runs_done']} of {summary['runs_planned']} runs; mean ± sample sd over seeds."]
    return "\n".join(lines) + "\n"


def write_data(data_dir: Path, s: dict) -> None:
    from scripts import make_quickstart_assets as gen

    data_dir.mkdir(parents=True, exist_ok=True)
    a_train, a_eval = gen.make_rows(random.Random(gen.SEED))
    gen.write_jsonl(data_dir / "A_train.jsonl", a_train)
    gen.write_jsonl(data_dir / "A_heldout.jsonl", a_eval[: s["eval_items"]])


def main(mode: str, out: Path, workers: int, resume: bool, env: dict, repo: Path) -> dict:
    from benchmarks.learning.measure import exact_match
    from benchmarks.learning.run2 import TOKENIZER, Bench, _pool_map

    t0 = time.perf_counter()
    s = p2.depth_settings(SETTINGS[mode], SETTINGS[mode]["depth"])
    work, log = out / "work", out / "work" / "runs.jsonl"
    done = {rec["key"]: rec["run"] for rec in map(json.loads, log.read_text().splitlines())} \
        if resume and log.is_file() else {}
    write_data(work / "data", s)
    depth_dir = work / f"depth-{s['layers']}"
    pref.pretrain(depth_dir, s, str(TOKENIZER))
    folder = str(depth_dir / "pretrained")
    before = own_mistakes(folder, work / "data", s)
    from transformers import AutoModelForCausalLM

    tok, _, val, test = _splits(str(work / "data"), folder, s["max_seq_len"], "preference")
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    before.update({part: exact_match(model, ex, tok.pad_token_id, tok.eos_token_id)
                   for part, ex in (("validation", val), ("test", test))})
    print(f"pre-trained: test exact match {100 * before['test']:.1f}%, {before['pairs']} own mistakes as pairs, "
          f"preferred on {100 * before['prefers_own_mistake']:.1f}%", flush=True)
    bench = Bench.__new__(Bench)
    bench.s = {"stages": []}
    cfg = bench.config(s["layers"])
    sft = pref.picked_lrs(repo)
    jobs = [{"settings": s, "loss": loss, "arm": arm, "seed": seed, "lr": sft[arm] * f, "lr_factor": f,
             "spec": p2.arm_spec(arm, cfg), "pretrained": folder, "tokenizer": folder,
             "data_dir": str(work / "data"), "threads": 1}
            for seed in s["seeds"] for loss in LOSSES for f in s["lr_factors"] for arm in ARMS]
    todo = [j for j in jobs if key(j) not in done]
    log.parent.mkdir(parents=True, exist_ok=True)

    def write() -> dict:
        summary = summarise(mode, s, before, list(done.values()), env)
        summary["wall_s"] = time.perf_counter() - t0
        (out / "learning-onpolicy.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "learning-onpolicy.md").write_text(render(summary))
        return summary

    summary = write()
    for k, (job, r) in enumerate(zip(todo, _pool_map(run_job, todo, workers)), 1):
        done[key(job)] = r
        with log.open("a") as f:
            f.write(json.dumps({"key": key(job), "run": r}) + "\n")
        print(f"[{k}/{len(todo)}] {r['loss']:<4} {r['arm']:<16} lr {r['lr']:<8.2g} seed {r['seed']}  val "
              f"{100 * r['after']['validation']:5.1f}  test {100 * r['after']['test']:5.1f}  {r['wall_s']:.0f} s "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        summary = write()
    return summary
