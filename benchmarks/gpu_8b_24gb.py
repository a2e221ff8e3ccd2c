"""Llama-3.1-8B fine-tuned under a 24 GiB cap, measured: benchmarks/gpu_8b_24gb.py.

Two configurations, each in a fresh subprocess under the same cap, trained by lisaft's own
trainer (`build_session` + `train_step`) on synthetic token batches:

  lisa      recipes/llama3.1-8b-lisa-24gb.yaml as shipped: LISA γ=2, paged AdamW 8-bit,
            gradient checkpointing, bf16
  full      full fine-tuning with paged AdamW 8-bit and optimizer.in_backward (torchtune's
            single-device 8B setup), same sequence length and batch, for as long as it survives

The model is built from the shipped Llama-3.1-8B config with random bf16 weights directly on the
GPU (nothing downloaded). For each run it records the PyTorch allocator's peak allocated and
reserved bytes, the device's used memory read through NVML (which also sees bitsandbytes' paged
state in unified memory, invisible to PyTorch's counters), step time, tokens/s, and the
estimator's prediction for the same settings.

    python benchmarks/gpu_8b_24gb.py                 # on a CUDA machine
    python benchmarks/gpu_8b_24gb.py --tiny          # same code path, CPU, scaled-down shape

Needs torch, transformers, bitsandbytes, pydantic, pyyaml (not datasets: the batches are
synthetic) and, on GPU, nvidia-ml-py for the NVML figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPE = REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
CONFIG_8B = REPO / "lisaft" / "memory" / "catalogue" / "llama-3.1-8b.json"
GiB = 1024**3

# The tiny mode keeps every switch of the real run (LISA, paged 8-bit, checkpointing, in_backward)
# but shrinks the model and sequence so it runs on a laptop CPU in seconds.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}

RUNS = {
    "lisa": [],
    "full": ["lisa.enabled=false", "optimizer.in_backward=true", "training.max_grad_norm=null",
             "training.grad_accum_steps=1"],
}


class _PadOnly:
    """The trainer needs only a pad id from the tokenizer when batches are given."""

    pad_token_id = 0


class NvmlPeak:
    """Polls the device's used memory through NVML in a thread: the only counter that includes
    the CUDA context and paged optimizer state resident on the GPU."""

    def __init__(self, index: int = 0, interval_s: float = 0.02):
        self.peak = None
        self.baseline = None
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.baseline = self.used()
        except Exception:  # no NVML (CPU, or nvidia-ml-py missing): figures stay null
            self._nvml = None
        self.interval_s = interval_s

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def __enter__(self):
        if self._nvml is not None:
            self.peak = self.used()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(self.interval_s)

    def __exit__(self, *exc):
        self._stop.set()
        if self._nvml is not None:
            self._thread.join()
            self.peak = max(self.peak, self.used())


def synthetic_examples(n: int, seq_len: int, vocab: int, seed: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, seq_len), generator=g).tolist()
    return [{"input_ids": row, "labels": list(row)} for row in ids]


def one_run(name: str, steps: int, tiny: bool, cap_gib: float, workdir: Path) -> dict:
    """Train one configuration in this process; returns its measurements."""
    import torch

    from lisaft.memory.command import estimate_for_recipe
    from lisaft.recipe import load_recipe
    from lisaft.trainer import build_session, train_step

    cuda = torch.cuda.is_available() and not tiny
    if tiny:
        config_path = workdir / "tiny-config.json"
        config_path.write_text(json.dumps(TINY_CONFIG))
    else:
        config_path = CONFIG_8B
    overrides = ["model.name_or_path=null", f"model.config={config_path}", "model.tokenizer=unused",
                 f"training.output_dir={workdir / name}", f"training.max_steps={steps}",
                 f"training.device={'cuda' if cuda else 'cpu'}", *RUNS[name]]
    from lisaft.models import flash_attn_available

    if tiny:
        overrides += ["data.max_seq_len=64", "model.dtype=float32"]
    if not (cuda and flash_attn_available()):
        overrides.append("model.attention=sdpa")  # same memory as FlashAttention 2 (docs/memory.md)
    recipe = load_recipe(RECIPE, overrides)
    t = recipe.training
    budget = int(cap_gib * GiB)
    estimate = estimate_for_recipe(recipe, device="cuda" if cuda else "cpu", budget_bytes=budget)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), 0)
    vocab = json.loads(Path(config_path).read_text())["vocab_size"]
    n = steps * t.batch_size * t.grad_accum_steps
    examples = synthetic_examples(n, recipe.data.max_seq_len, vocab, t.seed)
    result = {"run": name, "recipe_overrides": RUNS[name], "attention": recipe.model.attention,
              "optimizer": recipe.optimizer.name, "in_backward": recipe.optimizer.in_backward,
              "lisa": recipe.lisa.enabled, "seq_len": recipe.data.max_seq_len, "batch_size": t.batch_size,
              "cap_bytes": budget, "estimated_total_bytes": estimate.total_bytes,
              "estimated_components": estimate.components, "estimated_paged_host_bytes": estimate.paged_host_bytes,
              "steps_planned": steps, "steps_done": 0, "oom": False, "step_times_s": []}
    nvml = NvmlPeak()
    result["nvml_baseline_bytes"] = nvml.baseline
    with nvml:
        try:
            session = build_session(recipe, workdir / name, tokenizer=_PadOnly(), train_examples=examples,
                                    eval_examples=None)
            session.controller.activate_for_step(0)
            for step in range(steps):
                t0 = time.perf_counter()
                loss, tokens = train_step(session, step)
                if cuda:
                    torch.cuda.synchronize()
                result["step_times_s"].append(time.perf_counter() - t0)
                result["steps_done"] = step + 1
                result["last_loss"] = loss
                result["tokens_per_step"] = tokens
            dev_state, off_state = session.optimizers.state_bytes()
            result["optimizer_state_bytes"] = dev_state
            result["offloaded_state_bytes"] = off_state
        except torch.OutOfMemoryError as e:
            result["oom"] = True
            result["oom_message"] = str(e).splitlines()[0]
    if cuda:
        result["torch_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        result["torch_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    else:
        from lisaft.memory.measure import peak_rss_bytes

        result["peak_rss_bytes"] = peak_rss_bytes()
    result["nvml_peak_used_bytes"] = nvml.peak
    times = result["step_times_s"][2:] or result["step_times_s"]  # the first steps warm kernels up
    if times:
        result["step_time_s"] = sum(times) / len(times)
        result["tokens_per_s"] = result.get("tokens_per_step", 0) / result["step_time_s"]
    measured = result["nvml_peak_used_bytes"] if result["nvml_peak_used_bytes"] is not None else result.get("peak_rss_bytes")
    if measured:
        result["estimate_error"] = (estimate.total_bytes - measured) / measured
    gc.collect()
    return result


def table(results: list[dict]) -> str:
    def g(v):
        return "-" if v is None else f"{v / GiB:.2f}"

    rows = ["| run | steps | OOM | torch alloc GiB | torch reserved GiB | NVML used GiB | estimate GiB | tokens/s | s/step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        rows.append(f"| {r['run']} | {r['steps_done']}/{r['steps_planned']} | {r['oom']} | "
                    f"{g(r.get('torch_peak_allocated_bytes'))} | {g(r.get('torch_peak_reserved_bytes'))} | "
                    f"{g(r.get('nvml_peak_used_bytes'))} | {g(r.get('estimated_total_bytes'))} | "
                    f"{r.get('tokens_per_s', 0):.0f} | {r.get('step_time_s', 0):.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="scaled-down shape on CPU (tests)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 30, tiny 3)")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="per-process memory cap")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_8b_24gb.json")
    ap.add_argument("--only", choices=sorted(RUNS), help=argparse.SUPPRESS)  # child process mode
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.tiny else 30)

    if args.only:
        res = one_run(args.only, steps, args.tiny, args.cap_gib, args.workdir)
        print("RESULT " + json.dumps(res))
        return 0

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in RUNS:
            # A fresh process per run: the cap, the allocator's peaks and bitsandbytes' page
            # manager all start clean, and one run's OOM cannot poison the next.
            cmd = [sys.executable, __file__, "--only", name, "--steps", str(steps), "--cap-gib",
                   str(args.cap_gib), "--workdir", tmp] + (["--tiny"] if args.tiny else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                results.append({"run": name, "steps_done": 0, "steps_planned": steps, "oom": None,
                                "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] })
                continue
            results.append(json.loads(lines[-1][len("RESULT "):]))
    lisa = next((r for r in results if r["run"] == "lisa"), {})
    full = next((r for r in results if r["run"] == "full"), {})
    summary = {
        "mode": "tiny-cpu" if args.tiny else "gpu",
        "cap_gib": args.cap_gib,
        "lisa_fits_cap": bool(lisa.get("steps_done") == steps and not lisa.get("oom")),
        "lisa_speedup_vs_full": (lisa.get("tokens_per_s", 0) / full["tokens_per_s"]
                                 if full.get("tokens_per_s") else None),
        "runs": results,
    }
    if not args.tiny:
        import torch

        summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(table(results))
    print(f"LISA speed-up over full fine-tuning: {summary['lisa_speedup_vs_full']}")
    print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
