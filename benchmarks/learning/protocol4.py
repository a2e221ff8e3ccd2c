"""The learning benchmark's fourth protocol: preference tuning and GRPO on the real pretrained chat
model of protocol 3 (SmolLM2-135M-Instruct), on its task (two-digit additions answered with the
bare sum), scored with its measures.

    python -m benchmarks.learning.protocol4 [--model DIR] [--out DIR] [--max-runs N]

Objectives, each trained per method at equal memory (full; LISA γ=4; LoRA whose rank gives it LISA
γ=4's trainable parameters, so its moments take the same bytes):

- dpo / kto, on-policy (issue 47's protocol on this model): the start model's greedy answers to
  train prompts; a wrong one (not exactly the sum) makes DPO's pair (`chosen` the sum, `rejected`
  the model's own answer) and KTO's two rows (the sum desirable, the own answer undesirable).
- grpo: G completions per train prompt sampled on the policy, rewarded by `exact_sum` below: 1
  where the completion up to end of turn is the sum and nothing else, the held-out score's own
  test (the shipped `exact_match` also passes "180." and "180 ", which the score refuses).

Starts: `base`, the model as it ships (it answers wordily, 0% exact), and `sft`, a short SFT on
protocol 3's recipe (LISA γ=4, lr 1e-4) for 15 steps (its own cosine), made once and kept in OUT/work/, so
that GRPO's groups are not all scored 0. A run is scored as protocol 3 scores one: held-out greedy
exact accuracy (validation picks the lr, test is reported) and the two forgetting measures against
the base model (OUT/base.json, the same as protocol 3's). OUT/start-sft.json holds the SFT start's
own scores, OUT/onpolicy-<start>.json the on-policy data's counts.

Stages, most informative first: each method (cheapest first) at the middle of its lr grid, seed 0,
GRPO from the SFT start then DPO and KTO from the base; then GRPO from the base, DPO and KTO from
the SFT start, the same way; then the rest of the grid; one lr beyond it where the best is at its edge (seed 0); then
seeds 1 and 2 at each cell's picked lr. A GRPO cell whose middle run scored 0 in every step
(`unmoved`) skips the rest of its grid and its edge: those runs would repeat it. Each run writes
OUT/runs/<name>.json; a run whose file exists is skipped, so the command resumes where it
stopped. report4 makes the tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.learning import protocol3 as p3

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "results" / "learning4-real"
# The scoring keys are protocol 3's own, so that its base.json serves both.
SCORING = {k: p3.SETTINGS[k] for k in ("n_val", "n_test", "answer_tokens", "instruction_tokens", "fact_tokens")}
SETTINGS = dict(SCORING, threads=2, max_seq_len=64, warmup_steps=3, interval_steps=10,
                # protocol 3's train split is the SFT start's and every objective's prompt pool
                sft_steps=15, sft_lr=1e-4, sft_batch_size=8,
                # dpo / kto: pairs of the start's answers (up to answer_tokens) to the first train prompts
                pref_steps=20, pref_batch_size=4, pref_prompts=160, pref_max_seq_len=112, beta=0.1,
                # grpo: G completions of batch_size / G prompts per step. 4 prompts a step, not the
                # first attempt's 2: from the SFT start about 2 groups in 3 score alike and teach nothing
                grpo_steps=30, grpo_batch_size=16, num_generations=4, max_completion_length=16, temperature=1.0,
                grpo_reward="benchmarks.learning.protocol4:exact_sum")
# Cheapest first: the first stage gives every method's cells before the dearer methods run.
METHODS = {
    "lisa_g4": {"lisa": {"active_layers": 4, "state_policy": "discard"}},
    "lora_eq_g4": {"lisa": None, "lora": {"rank": "equal_params_lisa_g4"}},
    "full": {"lisa": None},
}
# Each method's lr grid, the same for every objective; the first lr is its middle, a third of the
# third protocol's SFT lr (recipes/smollm2-135m-dpo.yaml's for LISA; the toy on-policy protocol
# found DPO's best near 0.03-0.1 of SFT's). GRPO's first runs were at the top (the SFT lrs), where
# full fine-tuning broke the model in two steps (docs/learning.md), so it starts from the middle too.
GRIDS = {"full": [3e-6, 1e-5, 3e-5], "lisa_g4": [1e-5, 3e-5, 1e-4], "lora_eq_g4": [3e-5, 1e-4, 3e-4]}
# GRPO's, one grid step lower: its first attempt's middles lowered the reward it trained on (LISA,
# LoRA) or the facts (full fine-tuning) within 30 steps (docs/learning.md); TRL's default is 1e-6.
GRPO_GRIDS = {"full": [1e-6, 3e-6, 1e-5], "lisa_g4": [3e-6, 1e-5, 3e-5], "lora_eq_g4": [1e-5, 3e-5, 1e-4]}
# (objective, start) in the order the first stage runs them.
CELLS = [("grpo", "sft"), ("dpo", "base"), ("kto", "base"), ("grpo", "base"), ("dpo", "sft"), ("kto", "sft")]
SEEDS = [0, 1, 2]


def method_spec(method: str, cfg: dict) -> dict:
    """The arm's spec for benchmarks.learning.arms.lisaft_recipe, the LoRA rank worked out."""
    spec = {"kind": "lisaft", **json.loads(json.dumps(METHODS[method]))}
    if spec.get("lora", {}).get("rank") == "equal_params_lisa_g4":
        rank = max(1, round(p3.lisa_trainable_params(cfg, 4) / p3.lora_params_per_rank(cfg)))
        spec["lora"]["rank"] = rank
    return spec


def grid(objective: str, method: str) -> list[float]:
    return (GRPO_GRIDS if objective == "grpo" else GRIDS)[method]


def exact_sum(prompts, completions, answer, **kwargs) -> list[float]:
    """GRPO's reward: 1.0 where the completion (its text up to end of turn) is the row's sum and
    nothing else but surrounding whitespace, as the held-out exact score reads an answer."""
    from benchmarks.learning.run3 import is_exact
    from lisaft.grpo.rewards import completion_text

    return [float(is_exact(completion_text(c), a)) for c, a in zip(completions, answer, strict=True)]


def run_name(objective: str, start: str, method: str, lr: float, seed: int) -> str:
    return f"{objective}-{start}-{method}-lr{lr:g}-s{seed}"


def plan(done: dict[str, dict], first: tuple[str, str] | None = None) -> list[tuple[str, str, str, float, int]]:
    """The runs still to do, (objective, start, method, lr, seed), in the protocol's order; with
    `first` (objective, start), that cell's whole protocol (sweep, edge, seeds) before the others'
    (and the others' after it, for a second process while the cell's next stage waits)."""
    if first is None:
        return _plan(done, CELLS)
    head = _plan(done, [first])
    return head + [run for run in _plan(done, CELLS) if run not in head]


def _plan(done: dict[str, dict], cells: list[tuple[str, str]]) -> list[tuple[str, str, str, float, int]]:
    todo: list[tuple[str, str, str, float, int]] = []

    def add(objective: str, start: str, method: str, lr: float, seed: int) -> None:
        run = (objective, start, method, lr, seed)
        if run_name(*run) not in done and run not in todo:
            todo.append(run)

    for stage in (cells[:3], cells[3:]):
        for method in METHODS:
            for objective, start in stage:
                add(objective, start, method, grid(objective, method)[1], 0)
    for objective, start in cells:
        for method in METHODS:
            if unmoved(done, objective, start, method):
                continue
            for lr in grid(objective, method):
                add(objective, start, method, lr, 0)
    if todo:  # the edges and the seeds depend on what the sweep picks
        return todo
    picked = {}
    for objective, start in cells:
        for method in METHODS:
            if unmoved(done, objective, start, method):
                picked[objective, start, method] = grid(objective, method)[1]
                continue
            sweep = [r for r in done.values() if (r["objective"], r["start"], r["method"], r["seed"])
                     == (objective, start, method, 0)]
            beyond = p3.lr_beyond(grid(objective, method), p3.best_lr(sweep))
            if beyond is not None:
                add(objective, start, method, beyond, 0)
            picked[objective, start, method] = p3.best_lr(sweep)
    if todo:
        return todo
    for (objective, start, method), lr in picked.items():
        for seed in SEEDS[1:]:
            add(objective, start, method, lr, seed)
    return todo


def unmoved(done: dict[str, dict], objective: str, start: str, method: str) -> bool:
    """Whether the cell's seed-0 run at its middle lr was a GRPO run whose every step scored 0:
    every group alike, every advantage and so every gradient 0, and with GRPO's β 0 (the grpo
    section's default, kept here) and no weight decay (benchmarks/learning/arms.py) the model never
    moved. Any other lr samples the same completions from the same unmoved model,
    so the cell's sweep would repeat one run; its seeds, which sample differently, still run."""
    middle = done.get(run_name(objective, start, method, grid(objective, method)[1], 0))
    return objective == "grpo" and middle is not None and bool(middle["rewards"]) and not any(middle["rewards"])


def onpolicy_rows(pairs: list[tuple[int, int]], answers: list[str], limit: int) -> tuple[list[dict], list[dict]]:
    """DPO's pairs and KTO's rows (conversational) from the model's own greedy answers to the
    additions `pairs`: each wrong one, non-empty, up to `limit`; the right answer is the bare sum."""
    from scripts import make_smollm2_data as gen

    prefs: list[dict] = []
    for (a, b), own in zip(pairs, answers):
        if own and own != str(a + b) and len(prefs) < limit:
            prefs.append({"prompt": [{"role": "user", "content": gen.question(a, b)}],
                          "chosen": [{"role": "assistant", "content": str(a + b)}],
                          "rejected": [{"role": "assistant", "content": own}]})
    feedback = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for p in prefs for side in ("chosen", "rejected")]
    return prefs, feedback


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Protocol 4: DPO, KTO and GRPO on SmolLM2-135M-Instruct (resumable).")
    ap.add_argument("--model", help="the model folder (default: python -m benchmarks.real_model's)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    ap.add_argument("--first", choices=[f"{o}-{s}" for o, s in CELLS],
                    help="that cell's whole protocol (sweep, edge, seeds) before the other cells'")
    ap.add_argument("--threads", type=int, default=SETTINGS["threads"],
                    help="each run's torch threads (two processes at 1 each share a 2-core machine's runs)")
    args = ap.parse_args(argv)
    first = tuple(args.first.split("-")) if args.first else None
    from benchmarks import real_model
    from benchmarks.learning import report4, run4

    model = Path(args.model) if args.model else real_model.build(real_model.cache_dir())
    out = Path(args.out)
    bench = run4.Bench4(model, out, {**SETTINGS, "threads": args.threads})
    p3.run_until_done(out, lambda done: plan(done, first),
                      lambda run: bench.run_objective(*run[:3], method_spec(run[2], bench.config), *run[3:]),
                      lambda run: run_name(*run), report4.write, args.max_runs)


if __name__ == "__main__":
    main()
