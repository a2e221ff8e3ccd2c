"""GRPO against TRL's GRPOTrainer on the same tiny model, prompts, reward, G, completion length and
batch, interleaved: seconds per optimizer step of each, from whole runs at n and 2n steps (the
difference divided by n, so start-up and model loading cancel), cut into sampling (generate) and
the rest (scoring, log-probs, loss, backward, optimizer): lisaft's from the generation_s of its
train records, TRL's from a timer around the model's generate, which GRPOTrainer calls.

    python -m benchmarks.grpo_peer_bench --steps 8 --reps 3 --out benchmarks/results/peer/grpo_peer.json

Needs TRL (the bench extra). Both train full fine-tuning, float32, on the CPU (or CUDA with
--device cuda), AdamW at the same lr, without clipping differences (max_grad_norm 1.0 in both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import timed_on_this_machine

TOKENIZER = Path(__file__).resolve().parents[1] / "recipes" / "quickstart" / "tokenizer"
PROMPTS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
CFG = {"G": 4, "batch": 8, "completion": 16, "lr": 1e-2, "hidden": 64, "layers": 4}


def share_a(prompts, completions, **kw):
    return [c.count("a") / max(len(c), 1) for c in completions]


def _setup(folder: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig

    vocab = len(AutoTokenizer.from_pretrained(TOKENIZER))
    LlamaConfig(vocab_size=vocab, hidden_size=CFG["hidden"], intermediate_size=2 * CFG["hidden"],
                num_hidden_layers=CFG["layers"], num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, tie_word_embeddings=False).save_pretrained(folder / "model")
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return folder


def _lisaft_run(folder: Path, steps: int, device: str) -> tuple[float, float]:
    """The run's seconds, and the seconds of them spent sampling."""
    from lisaft.metrics.log import read_metrics
    from lisaft.train import train

    run = folder / f"lisaft-{steps}-{time.monotonic_ns()}"
    recipe = {"model": {"config": str(folder / "model" / "config.json"), "tokenizer": str(TOKENIZER),
                        "dtype": "float32", "attention": "sdpa"},
              "data": {"train": str(folder / "prompts.jsonl"), "format": "prompts", "max_seq_len": 64},
              "optimizer": {"name": "adamw_32bit", "lr": CFG["lr"], "weight_decay": 0.0},
              "scheduler": {"name": "constant", "warmup_steps": 0},
              "training": {"seed": 0, "batch_size": CFG["batch"], "max_steps": steps, "log_every": 1,
                           "output_dir": str(run), "device": device},
              "grpo": {"reward_funcs": ["benchmarks.grpo_peer_bench:share_a"], "num_generations": CFG["G"],
                       "max_completion_length": CFG["completion"]}}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    t0 = time.perf_counter()
    assert train(path, show=False) == 0
    seconds = time.perf_counter() - t0
    return seconds, sum(r["generation_s"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r)


def _timed_generate(model, spent: list[float]) -> None:
    """The model's generate, timed into `spent` (GRPOTrainer samples through it on one process)."""
    generate = model.generate

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    model.generate = timed


def _trl_run(folder: Path, steps: int, device: str) -> tuple[float, float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    t0 = time.perf_counter()
    import torch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder / "model"))
    spent: list[float] = []
    _timed_generate(model, spent)
    args = GRPOConfig(output_dir=str(folder / "trl"), per_device_train_batch_size=CFG["batch"],
                      num_generations=CFG["G"], max_completion_length=CFG["completion"], learning_rate=CFG["lr"],
                      lr_scheduler_type="constant", weight_decay=0.0, max_steps=steps, report_to=[],
                      use_cpu=device == "cpu", bf16=False, save_strategy="no", logging_steps=1, seed=0)
    GRPOTrainer(model=model, reward_funcs=share_a, args=args, train_dataset=Dataset.from_list(
        [{"prompt": p} for p in PROMPTS]), processing_class=AutoTokenizer.from_pretrained(TOKENIZER)).train()
    assert spent, "GRPOTrainer did not sample through model.generate: the generation timer saw nothing"
    return time.perf_counter() - t0, sum(spent)


def measure(steps: int, reps: int, device: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = _setup(Path(tmp))
        per_step: dict[str, list[float]] = {"lisaft": [], "trl": []}
        generation: dict[str, list[float]] = {"lisaft": [], "trl": []}
        for run in (_lisaft_run, _trl_run):  # imports and first-call costs out of the timings
            run(folder, 1, device)
        for _ in range(reps):  # interleaved, so a change in the machine's load falls on both
            for name, run in (("lisaft", _lisaft_run), ("trl", _trl_run)):
                (short, short_gen), (long, long_gen) = run(folder, steps, device), run(folder, 2 * steps, device)
                per_step[name].append((long - short) / steps)
                generation[name].append((long_gen - short_gen) / steps)
    med = {k: statistics.median(v) for k, v in per_step.items()}
    gen = {k: statistics.median(v) for k, v in generation.items()}
    return {"seconds_per_step": per_step, "median_seconds_per_step": med,
            "generation_seconds_per_step": generation, "median_generation_seconds_per_step": gen,
            "median_training_seconds_per_step": {k: med[k] - gen[k] for k in med},
            "generation_share": {k: gen[k] / med[k] for k in med},
            "lisaft_steps_per_s_over_trl": med["trl"] / med["lisaft"],
            "lisaft_generation_speed_over_trl": gen["trl"] / gen["lisaft"],
            "lisaft_training_speed_over_trl": (med["trl"] - gen["trl"]) / (med["lisaft"] - gen["lisaft"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = timed_on_this_machine({**CFG, "steps": a.steps, "reps": a.reps, "device": a.device},
                                   lambda: measure(a.steps, a.reps, a.device))
    print(json.dumps(result, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
