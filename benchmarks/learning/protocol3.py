"""The learning benchmark's third protocol: a real pretrained chat model (SmolLM2-135M-Instruct,
benchmarks/real_model.py) learns a new skill; what does each method teach it, and what does it
make it forget?

    python -m benchmarks.learning.protocol3 [--model DIR] [--out DIR] [--max-runs N]

Each arm fine-tunes the model on two-digit additions in its chat format (scripts/make_smollm2_data.py)
for a few dozen steps, at equal memory as protocol 2 has it: LoRA's rank gives it LISA γ=2's
trainable parameters (so its moments take the same bytes), APOLLO's rank gives it LISA γ=2's
optimizer-state bytes. After training it is scored on:

- new skill: greedy exact accuracy on held-out additions (the answer up to end of turn is the sum,
  nothing else), with 48 new tokens of room; `lenient` counts an answer whose last number is the sum.
  The validation split picks the lr, the test split is reported.
- forgetting (a): mean NLL per token of the base model's own greedy answers to a fixed set of 202
  varied instructions (computed once, base.json), against the base model's own NLL on them.
- forgetting (b): accuracy on the facts of a fixed list that the base model answers right.

The work goes in stages, most informative first: every arm at the middle of its lr grid (seed 0),
then the rest of the grid, one lr beyond the grid where the best is at an edge, then seeds 1 and 2
at the picked lr. Each run writes OUT/runs/<arm>-lr<lr>-s<seed>.json and a run whose file exists
is skipped, so the command picks up where it stopped. report3 makes the tables from the files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "results" / "learning3-real"
SETTINGS = dict(steps=30, batch_size=8, max_seq_len=64, warmup_steps=3, interval_steps=10, threads=2,
                n_val=48, n_test=96, answer_tokens=48, instruction_tokens=48, fact_tokens=24)
SPLITS = {"train": 400, "eval": 48, "val": SETTINGS["n_val"], "test": SETTINGS["n_test"]}
ADAMW_LRS, ADAPTER_LRS = [3e-5, 1e-4, 3e-4], [3e-4, 1e-3, 3e-3]
# name -> (spec for benchmarks.learning.arms.lisaft_recipe, lr grid). "equal_state_lisa_g2" ranks
# are worked out from the model's config.
ARMS = {
    # First: at lr 1e-4, seed 0, this is recipes/smollm2-135m-sft.yaml's run (the README quotes it).
    "lisa_g4": ({"lisa": {"active_layers": 4, "state_policy": "discard"}}, ADAMW_LRS),
    "full": ({"lisa": None}, [1e-5, 3e-5, 1e-4]),
    "lisa_g2": ({"lisa": {"active_layers": 2, "state_policy": "discard"}}, ADAMW_LRS),
    "lora_eq_g2": ({"lisa": None, "lora": {"rank": "equal_state_lisa_g2"}}, ADAPTER_LRS),
    "dora_eq_g2": ({"lisa": None, "lora": {"rank": "equal_state_lisa_g2", "dora": True}}, ADAPTER_LRS),
    "qlora_eq_g2": ({"lisa": None, "lora": {"rank": "equal_state_lisa_g2", "quantize": "nf4"}}, ADAPTER_LRS),
    "apollo_eq_g2": ({"lisa": None, "optimizer": {"name": "apollo", "rank": "equal_state_lisa_g2"}}, ADAMW_LRS),
    "apollo_mini": ({"lisa": None, "optimizer": {"name": "apollo_mini"}}, [1e-4, 3e-4, 1e-3]),
    # The step on the CPU in layer order: must give full's numbers at the same lr and seed.
    "full_cpu_offload": ({"lisa": None, "optimizer": {"cpu_offload": True}}, [3e-5]),
}
SEEDS = [0, 1, 2]


def kv_width(cfg: dict) -> int:
    """Output width of the key and value projections (grouped-query attention: fewer heads)."""
    heads = cfg["num_attention_heads"]
    return (cfg.get("num_key_value_heads") or heads) * (cfg.get("head_dim") or cfg["hidden_size"] // heads)


def layer_params(cfg: dict) -> int:
    """One decoder layer's parameters (grouped-query attention, gated MLP, two norms)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = kv_width(cfg)
    return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h


def embedding_params(cfg: dict) -> int:
    """Embeddings and head (one matrix when tied) and the final norm: LISA trains them always."""
    vh = cfg["vocab_size"] * cfg["hidden_size"]
    return vh * (1 if cfg.get("tie_word_embeddings") else 2) + cfg["hidden_size"]


def lisa_trainable_params(cfg: dict, gamma: int) -> int:
    return gamma * layer_params(cfg) + embedding_params(cfg)


def lora_params_per_rank(cfg: dict) -> int:
    """LoRA parameters per unit of rank on the seven linear layers of every decoder layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = kv_width(cfg)
    return cfg["num_hidden_layers"] * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))


def apollo_rank_equal_state(cfg: dict) -> int:
    """APOLLO's rank whose state is LISA γ=2's (8 B per trainable parameter): 8 B per rank per
    channel of each decoder matrix's larger side, plus the other tensors' adamw_8bit moments
    (embeddings 2 B per parameter, norms 8 B), as protocol 2 counts them."""
    h, i, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    rest = 2 * (embedding_params(cfg) - h) + 8 * (2 * n + 1) * h
    per_rank = 8 * n * (4 * h + 3 * max(h, i))
    return max(1, round((8 * lisa_trainable_params(cfg, 2) - rest) / per_rank))


def arm_spec(arm: str, cfg: dict) -> dict:
    spec = {"kind": "lisaft", **json.loads(json.dumps(ARMS[arm][0]))}
    if spec.get("lora", {}).get("rank") == "equal_state_lisa_g2":
        spec["lora"]["rank"] = max(1, round(lisa_trainable_params(cfg, 2) / lora_params_per_rank(cfg)))
    if spec.get("optimizer", {}).get("rank") == "equal_state_lisa_g2":
        spec["optimizer"]["rank"] = apollo_rank_equal_state(cfg)
    return spec


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-lr{lr:g}-s{seed}"


def last_number(text: str) -> int | None:
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return int(found[-1]) if found else None


def lr_beyond(grid: list[float], best: float) -> float | None:
    """One lr past the grid's edge where the best one is at it (x or / 3); None inside the grid."""
    if len(grid) < 2 or best not in (grid[0], grid[-1]):
        return None
    return round(best * 3 if best == grid[-1] else best / 3, 10)


def best_lr(runs: list[dict]) -> float:
    """The lr whose mean validation exact accuracy is highest; ties go to the lower validation NLL."""
    by_lr: dict[float, list[dict]] = {}
    for r in runs:
        by_lr.setdefault(r["lr"], []).append(r)
    def score(lr: float) -> tuple[float, float]:
        rs = by_lr[lr]
        return (sum(r["val"]["exact"] for r in rs) / len(rs), -sum(r["val"]["nll"] for r in rs) / len(rs))
    return max(by_lr, key=score)


def plan(done: dict[str, dict]) -> list[tuple[str, float, int]]:
    """The runs still to do, in the protocol's order, given the finished ones (name -> record)."""
    todo: list[tuple[str, float, int]] = []
    def add(arm: str, lr: float, seed: int) -> None:
        if run_name(arm, lr, seed) not in done and (arm, lr, seed) not in todo:
            todo.append((arm, lr, seed))
    for arm, (_, grid) in ARMS.items():
        add(arm, grid[len(grid) // 2], 0)
    for arm, (_, grid) in ARMS.items():
        for lr in grid:
            add(arm, lr, 0)
    if todo:  # later stages depend on the sweep's outcome
        return todo
    picked = {}
    for arm, (_, grid) in ARMS.items():
        sweep = [r for r in done.values() if r["arm"] == arm and r["seed"] == 0]
        beyond = lr_beyond(grid, best_lr(sweep))
        if beyond is not None:
            add(arm, beyond, 0)
        picked[arm] = best_lr(sweep)
    if todo:
        return todo
    for arm, lr in picked.items():
        if len(ARMS[arm][1]) > 1:
            for seed in SEEDS[1:]:
                add(arm, lr, seed)
    return todo


def load_done(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Protocol 3: methods on SmolLM2-135M-Instruct (resumable).")
    ap.add_argument("--model", help="the model folder (default: python -m benchmarks.real_model's)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    args = ap.parse_args(argv)
    from benchmarks import real_model
    from benchmarks.learning import run3

    model = Path(args.model) if args.model else real_model.build(real_model.cache_dir())
    out = Path(args.out)
    bench = run3.Bench(model, out, SETTINGS)
    from benchmarks.learning import report3

    run_until_done(out, plan, lambda run: bench.run(run[0], arm_spec(run[0], bench.config), *run[1:]),
                   lambda run: run_name(*run), report3.write, args.max_runs)


def _claim_path(out: Path, name: str) -> Path:
    return out / "work" / "claims" / name


def claim(out: Path, name: str) -> bool:
    """Takes run `name` for this process (OUT/work/claims/NAME holds its pid), so that two
    processes on one protocol never run the same run; a claim whose process is gone is taken over."""
    path = _claim_path(out, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            os.kill(int(path.read_text() or 0), 0)
            return False  # its process is alive
        except PermissionError:
            return False  # alive, another user's
        except (ProcessLookupError, ValueError, FileNotFoundError):
            path.unlink(missing_ok=True)
            return claim(out, name)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def run_until_done(out: Path, plan, run_one, name, report, max_runs: int | None, wait_s: float = 30.0) -> None:
    """The resumable loop of protocols 3 and 4: the first run `plan` still wants given the run
    files in `out` and no other process has claimed, one at a time, each reported in a line and in
    the rewritten report, until the plan is empty or `max_runs` have run. Where every wanted run is
    another process's, it waits for their files (the next stage may depend on them)."""
    t0, count = time.perf_counter(), 0
    while max_runs is None or count < max_runs:
        todo = plan(load_done(out))
        if not todo:
            break
        run = next((r for r in todo if claim(out, name(r))), None)
        if run is None:
            time.sleep(wait_s)
            continue
        try:
            rec = run_one(run)
        finally:
            _claim_path(out, name(run)).unlink(missing_ok=True)
        count += 1
        print(f"[{count}] {name(run)}: test exact {100 * rec['test']['exact']:.1f}% "
              f"(lenient {100 * rec['test']['lenient']:.1f}%), instructions NLL {rec['instructions_nll']:.3f}, "
              f"facts {100 * rec['facts']:.1f}%, {rec['train_s']:.0f} s train ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        report(out)
    report(out)
    print(f"wrote {out}; runs still to come: {len(plan(load_done(out)))} in the next stage")


if __name__ == "__main__":
    main()
