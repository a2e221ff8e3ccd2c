"""Do bfloat16 and 8-bit moments learn as float32 ones? benchmarks/moments_bench.py.

The precision benchmark's setting (benchmarks/precision_bench.py: its small Llama saved once as a
float32 folder, the quickstart instruction data, constant lr, clipping at 1.0, full fine-tuning,
training.device cpu) at lr 2e-5, bf16 weights with stochastic rounding and optimizer.cpu_offload,
three arms advanced in lockstep over the same batches:

    float32    adamw_32bit, float32 moments (the reference)
    bfloat16   adamw_32bit, optimizer.moments_dtype bfloat16
    8bit       adamw_8bit, bitsandbytes' blockwise 8-bit moments

Per arm: eval loss before and after, and the share of the float32 arm's eval-loss decrease kept.

    python -m benchmarks.moments_bench                # 4 layers, 50 steps
    python -m benchmarks.moments_bench --quick        # 2 layers, 25 steps

Writes moments.json into --out (default benchmarks/results/moments, or moments-quick).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks import precision_bench as pb
from lisaft.config.schema import recipe_from_dict
from lisaft.train import build_session, train_step
from lisaft.train.evaluate import evaluate

REPO = Path(__file__).resolve().parents[1]

LR = 2e-5
ARMS = {"float32": ("adamw_32bit", "float32"), "bfloat16": ("adamw_32bit", "bfloat16"),
        "8bit": ("adamw_8bit", "float32")}


def _recipe(model_dir: Path, run_dir: Path, arm: str, cfg: dict, seed: int):
    """The precision benchmark's bf16 recipe (stochastic rounding) at this benchmark's lr, with the
    step on the CPU and the arm's moments."""
    name, moments = ARMS[arm]
    d = pb.bench_recipe(model_dir, run_dir, name, "bf16_stochastic", cfg, seed).model_dump()
    d["optimizer"].update(lr=LR, cpu_offload=True, moments_dtype=moments)
    return recipe_from_dict(d, "moments_bench")


def run(cfg: dict, work: Path, seed: int) -> dict:
    model_dir = work / "model"
    pb.save_model(cfg, model_dir, seed)
    data: dict = {}
    sessions = {}
    for arm in ARMS:
        s = sessions[arm] = build_session(_recipe(model_dir, work / arm, arm, cfg, seed), work / arm, **data)
        data.update(tokenizer=s.tokenizer, train_examples=s.train_examples, eval_examples=s.eval_examples)
    before = {arm: evaluate(s)["eval_loss"] for arm, s in sessions.items()}
    for step in range(cfg["steps"]):
        for arm in ARMS:
            train_step(sessions[arm], step)
    rows = {}
    for arm, s in sessions.items():
        s.optimizers.wait()
        rows[arm] = {"eval_loss_before": before[arm], "eval_loss": evaluate(s)["eval_loss"]}
        rows[arm]["decrease"] = rows[arm]["eval_loss_before"] - rows[arm]["eval_loss"]
    ref = rows["float32"]["decrease"]
    for r in rows.values():
        r["share_of_float32_decrease"] = round(r["decrease"] / ref, 3) if ref > 0 else None
    return {"lr": LR, "steps": cfg["steps"], "layers": cfg["layers"], "hidden": cfg["hidden"], "seed": seed,
            "arms": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cfg = pb.QUICK if args.quick else pb.FULL
    out = args.out or REPO / "benchmarks" / "results" / ("moments-quick" if args.quick else "moments")
    with tempfile.TemporaryDirectory() as tmp:
        result = run(cfg, Path(tmp), args.seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moments.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
