"""The end-of-run memory table on a chat run with padded batches: benchmarks/chat_memory.py.

A newcomer's chat workflow, rebuilt from shipped files: conversations of 1 to 12 turns made from
the quickstart's string tasks (a system prompt of varying length, then user and assistant
turns), the quickstart tokenizer's chat template, a randomly initialised 6-layer model of the
quickstart's width, LISA γ=2, batches of 4 rows padded to the longest (no packing), 30 steps.
It runs `lisaft train` as a user would and keeps the table it prints at the end (estimated vs
measured: weights, gradients, optimizer states, activations, peak RSS) and the shape it names.

    python -m benchmarks.chat_memory      # writes benchmarks/results/chat_memory/chat_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart"
ROW = re.compile(r"│ (\w[\w ()]*?) +│ +([\d.]+ \w+) │ +([\d.]+ \w+) │ +([+-][\d.]+%) │")


def write_workflow(work: Path, seed: int = 0) -> Path:
    rng = random.Random(seed)
    tasks = [json.loads(line) for line in (QUICKSTART / "train.jsonl").read_text().splitlines()[:400]]

    def conversation() -> dict:
        messages = [{"role": "system", "content": "you transform strings " * rng.randint(0, 6)}]
        for _ in range(rng.randint(1, 12)):
            t = tasks[rng.randrange(len(tasks))]
            messages += [{"role": "user", "content": f"{t['instruction']}: {t.get('input', '')}"},
                         {"role": "assistant", "content": t["output"]}]
        return {"messages": messages}

    for name, n in (("train", 300), ("eval", 40)):
        (work / f"{name}.jsonl").write_text("".join(json.dumps(conversation()) + "\n" for _ in range(n)))
    config = json.loads((QUICKSTART / "config.json").read_text())
    config.update(num_hidden_layers=6, max_position_embeddings=1024)
    (work / "config.json").write_text(json.dumps(config))
    recipe = work / "recipe.yaml"
    recipe.write_text(
        f"model: {{config: config.json, tokenizer: {QUICKSTART / 'tokenizer'}, dtype: float32, attention: sdpa}}\n"
        "data: {train: train.jsonl, eval: eval.jsonl, format: chat, max_seq_len: 512}\n"
        "optimizer: {name: adamw_32bit, lr: 3.0e-3}\n"
        "lisa: {enabled: true, active_layers: 2, interval_steps: 10}\n"
        "training: {batch_size: 4, max_steps: 30, log_every: 10, eval_every: 0, output_dir: run}\n")
    return recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "chat_memory")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        recipe = write_workflow(Path(tmp))
        env = {**os.environ, "COLUMNS": "120",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "lisaft", "train", str(recipe)], cwd=tmp, env=env,
                              capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    rows = {name: {"estimated": est, "measured": meas, "difference": diff}
            for name, est, meas, diff in ROW.findall(done.stdout)}
    shape = next((line for line in done.stdout.splitlines() if line.startswith("(estimated for")), "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chat_memory.json").write_text(json.dumps({"rows": rows, "note": shape}, indent=2) + "\n")
    for name, r in rows.items():
        print(f"{name:22} {r['estimated']:>12} {r['measured']:>12} {r['difference']:>8}")
    print(shape)


if __name__ == "__main__":
    main()
