"""A resume on CUDA: stop a run mid-interval, resume it, and get the same losses.

recipes/quickstart.yaml (its shipped model config, tokenizer and data) trained by `lisaft train`'s
own entry point, 8 steps with LISA re-sampling every 3, three times in one process: straight
through; stopped after step 5 as a signal stops it (a checkpoint then, inside an interval);
resumed from that checkpoint to the end. Its losses of steps 6-8 must equal the straight run's,
bit for bit: deterministic algorithms are on (torch.use_deterministic_algorithms, the cuBLAS
workspace setting it needs), so a difference is the resume's, not the kernels' scheduling. Two
variants: the recipe's optimizer (AdamW 32-bit on the device), then, on CUDA only, the optimizer
on the CPU (optimizer.cpu_offload: the host copies and pinned buffers come back from the
checkpoint). The result is written after each variant.

    python -m benchmarks.gpu_resume --out benchmarks/results/gpu/resume.json
    python -m benchmarks.gpu_resume --dry-run --out /tmp/resume.json      # the same on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart.yaml"
STEPS, SAVE_EVERY, STOP_AT = 8, 4, 5


def _losses(run: Path) -> dict[int, float]:
    from lisaft.metrics.log import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def variant(device: str, extra: list[str], work: Path) -> dict:
    """Straight, stopped, resumed: the losses of each and whether they agree."""
    from lisaft.train.commands import resume, train

    common = [f"training.device={device}", f"training.max_steps={STEPS}", f"training.save_every={SAVE_EVERY}",
              "training.eval_every=0", "training.log_every=1", "lisa.interval_steps=3", "training.keep_last=2",
              *extra]
    straight, cut = work / "straight", work / "cut"
    t0 = time.perf_counter()
    train(RECIPE, [*common, f"training.output_dir={straight}"], show=False)
    stopped = train(RECIPE, [*common, f"training.output_dir={cut}"], show=False, _stop_at=STOP_AT)
    resumed = resume(cut, show=False)
    a, b = _losses(straight), _losses(cut)
    tail = [s for s in sorted(a) if s > STOP_AT]
    diffs = [abs(a[s] - b.get(s, float("nan"))) for s in tail]
    return {"overrides": extra, "stopped_exit": stopped, "resumed_exit": resumed, "straight": a, "resumed": b,
            "compared_steps": tail, "max_abs_diff": max(diffs), "ok": all(d == 0.0 for d in diffs) and resumed == 0,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="on CPU")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: cuBLAS reads it once
    import torch

    torch.use_deterministic_algorithms(True)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    variants = {"resident": []}
    if device == "cuda":
        variants["cpu_offload"] = ["optimizer.cpu_offload=true"]
    result: dict = {"device": device, "steps": STEPS, "save_every": SAVE_EVERY, "stop_at": STOP_AT, "variants": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants.items():
            try:
                r = variant(device, extra, Path(tmp) / name)
            except Exception as e:  # one variant's failure must not lose the other's result
                r = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            result["variants"][name] = r
            print(f"{name}: {json.dumps({k: r.get(k) for k in ('ok', 'max_abs_diff', 'error', 'seconds')})}",
                  flush=True)
            args.out.write_text(json.dumps(result, indent=1))
    return 0 if all(r["ok"] for r in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
