"""What fits per rank under training.fsdp, by the estimator: benchmarks/fsdp_fit.py.

Llama-3.1-8B and Llama-3.1-70B, LISA γ=2 and full fine-tuning, on 1, 2, 4 and 8 ranks, against a
24 GB card (rtx-4090) and an 80 GB card (h100-80gb). Every run is the shipped
recipes/llama3.1-8b-lisa-24gb.yaml (bf16, FlashAttention, gradient checkpointing, packed
2,048-token rows, batch 1) with adamw_8bit, the 8-bit optimizer FSDP runs (it refuses the paged
ones), the model swapped for 70B and `lisa.enabled: false` for full fine-tuning. One rank is one
GPU without FSDP (FSDP on one rank holds as much, plus its gathered copies); full fine-tuning on one rank is also given
with `optimizer.cpu_offload` (moments, gradients and the step on the CPU), which runs on one
device only. The weights come from model.name_or_path, so under FSDP each rank reads only its
slices (lisaft/distributed/fsdp.py load_sharded) and the peak is the training step's. Nothing is measured
here: these are `lisaft estimate-memory` figures (lisaft/memory/sharded.py says what each rank
holds), for the docs' table in docs/distributed.md.

    python -m benchmarks.fsdp_fit     # writes benchmarks/results/fsdp_fit/fsdp_fit.{json,md}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lisaft.memory.command import EstimateFlags, build_settings
from lisaft.memory.estimate import GiB, compute
from lisaft.memory.gpus import gpu
from lisaft.memory.render import step_peak_phase

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
MODELS = ("llama-3.1-8b", "llama-3.1-70b")
METHODS = {"LISA γ=2": [], "full": ["lisa.enabled=false"]}
RANKS = (1, 2, 4, 8)
CARDS = {"24 GB": gpu("rtx-4090"), "80 GB": gpu("h100-80gb")}


def estimate(model: str, overrides: list[str], ranks: int, cpu_offload: bool = False):
    flags = EstimateFlags(recipe=RECIPE, model=model, optimizer="adamw_8bit", device="cuda",
                          overrides=tuple(overrides), cpu_offload=cpu_offload, host_ram="1TiB", fsdp=ranks > 1,
                          ranks=ranks if ranks > 1 else None)
    s = build_settings(flags, CARDS["24 GB"].usable_bytes)
    return compute(s)


def row(model: str, method: str, ranks: int, cpu_offload: bool = False) -> dict:
    est = estimate(model, METHODS[method], ranks, cpu_offload)
    # The training step's own peak; a model built from model.config would add a set-up moment
    # (model_load: each rank builds the whole model before fully_shard splits it), read shard by
    # shard from name_or_path it has none.
    step = step_peak_phase(est)
    training = est.phases[step]
    out = {
        "model": model, "method": method, "ranks": ranks, "fsdp": ranks > 1, "cpu_offload": cpu_offload,
        "total_bytes": est.total_bytes, "training_peak_bytes": training, "peak_phase": est.peak_phase,
        "load_bytes": est.phases.get("model_load"), "components": est.components, "sizes": est.sizes,
        "step_phase": step, "step_components": est.phase_components[step],
        "host_bytes": sum(est.host_components.values()),  # optimizer.cpu_offload's host table
    }
    for name, card in CARDS.items():
        out[f"fits {name}"] = est.total_bytes <= card.usable_bytes
        out[f"step fits {name}"] = training <= card.usable_bytes
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| model | method | ranks | per-rank peak | 24 GB | 80 GB |", "|---|---|---|---|---|---|"]
    for r in rows:
        ranks = f"{r['ranks']}" + (" (FSDP)" if r["fsdp"] else " + cpu_offload" if r["cpu_offload"] else "")
        host = f" (+{r['host_bytes'] / GiB:.0f} GiB host)" if r["host_bytes"] else ""
        fits = ["fits" if r[f"fits {card}"] else "no" for card in CARDS]
        lines.append(f"| {r['model']} | {r['method']} | {ranks} | {r['total_bytes'] / GiB:.1f} GiB{host} | "
                     f"{fits[0]} | {fits[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "fsdp_fit")
    args = parser.parse_args()
    rows = []
    for model in MODELS:
        for method in METHODS:
            rows += [row(model, method, n) for n in RANKS]
            if method == "full":
                rows.insert(len(rows) - len(RANKS) + 1, row(model, method, 1, cpu_offload=True))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"recipe": str(RECIPE.relative_to(REPO)), "optimizer": "adamw_8bit",
              "cards": {name: {"gpu": c.name, "usable_bytes": c.usable_bytes} for name, c in CARDS.items()},
              "rows": rows}
    (args.out / "fsdp_fit.json").write_text(json.dumps(result, indent=1))
    table = markdown(rows)
    (args.out / "fsdp_fit.md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
