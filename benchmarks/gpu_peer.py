"""Speed against a peer on the same GPU: lisaft's LoRA against Hugging Face Trainer's.

The same model (Llama-3.1-8B's config, random bf16 weights built on the device; the tiny
config of benchmarks/gpu_8b_24gb.py with --dry-run), the same adapters (peft LoRA, rank 8, alpha
16, every linear layer), batch 1 of 2,048 tokens (the tiny table's length with --dry-run), AdamW
at 2e-4 with a constant rate, no clipping, gradient checkpointing, sdpa attention, both under the
same 24 GiB cap. lisaft's side is gpu_8b_24gb.py's `peer-lisaft` run (its own trainer); HF
Trainer's is `hf_trainer_run` below, in a fresh process too. Tokens/s of each over the steps
from the third on (the first warm kernels up), side by side. Each side's result is written
into --out as soon as it ends.

    python -m benchmarks.gpu_peer --out benchmarks/results/gpu/peer.json
    python -m benchmarks.gpu_peer --dry-run --out /tmp/peer.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import synthetic_examples
from benchmarks.gpu_8b_24gb import BY_NAME, CONFIG_8B, TINY_CONFIG, TINY_SEQ, Config, GiB, cap_allocator, one_run
from benchmarks.gpu_box import remaining, run_boxed

REPO = Path(__file__).resolve().parents[1]
PEER = BY_NAME["peer-lisaft"]


def hf_trainer_run(tiny: bool, steps: int, cap_gib: float) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments

    cuda = torch.cuda.is_available() and not tiny
    if cuda:
        cap_allocator(int(cap_gib * GiB))
    config = LlamaConfig(**TINY_CONFIG) if tiny else AutoConfig.from_pretrained(str(CONFIG_8B))
    seq = TINY_SEQ[2048] if tiny else 2048
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if tiny else torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    rows = synthetic_examples(steps, seq, config.vocab_size, 0)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                                 max_steps=steps, learning_rate=2e-4, lr_scheduler_type="constant", warmup_steps=0,
                                 weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch", logging_steps=1,
                                 save_strategy="no", report_to=[], use_cpu=not cuda, dataloader_num_workers=0,
                                 gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
                                 remove_unused_columns=False, disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[Timer()]).train()
    timed = times[2:] or times
    step_s = sum(timed) / len(timed)
    out = {"run": "hf-trainer", "steps_done": len(times), "step_times_s": times, "step_time_s": step_s,
           "tokens_per_s": seq / step_s, "seq_len": seq}
    if cuda:
        out["torch_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def _side(cmd: list[str], tiny: bool, timeout: float | None = None) -> dict:
    """One side in a fresh process on CUDA (its own cap and peaks), killed with whatever it started
    past `timeout`; in this one in a dry run, which has neither and would pay the imports twice more."""
    if tiny:
        try:
            if "--hf-only" in cmd:
                return hf_trainer_run(True, int(cmd[cmd.index("--steps") + 1]), 24.0)
            steps, workdir = int(cmd[cmd.index("--steps") + 1]), Path(cmd[cmd.index("--workdir") + 1])
            return one_run(Config(**{**PEER.__dict__, "steps": steps}), True, 24.0, workdir)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    if timeout is not None and timeout <= 0:
        return {"error": "timeout (budget): no time left"}
    rc, stdout, stderr = run_boxed([sys.executable, "-m", *cmd], timeout, cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    if rc == 124:
        return {"error": "timeout (budget)"}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if rc or not lines:
        return {"error": ((stderr or stdout).strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny, on CPU")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)  # the HF Trainer process
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=None, help="both sides end within this (default: no limit)")
    ap.add_argument("--started", type=float, default=time.time(), help="time.time() the budget counts from")
    args = ap.parse_args(argv)
    steps = args.steps or (4 if args.dry_run or args.tiny else PEER.steps)
    if args.hf_only:
        print("RESULT " + json.dumps(hf_trainer_run(args.tiny, steps, 24.0)))
        return 0
    result: dict = {"steps": steps, "sides": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"lisaft": ["benchmarks.gpu_8b_24gb", "--only", PEER.name, "--steps", str(steps), "--workdir", tmp],
                 "hf-trainer": ["benchmarks.gpu_peer", "--hf-only", "--steps", str(steps)]}
        for name, cmd in sides.items():
            result["sides"][name] = _side(cmd, args.dry_run, remaining(args.started, args.budget_s))
            print(f"{name}: {json.dumps({k: result['sides'][name].get(k) for k in ('tokens_per_s', 'error')})}",
                  flush=True)
            args.out.write_text(json.dumps(result, indent=1))
    ours, theirs = (result["sides"][k].get("tokens_per_s") for k in ("lisaft", "hf-trainer"))
    if ours and theirs:
        result["lisaft_over_hf_trainer"] = ours / theirs
        args.out.write_text(json.dumps(result, indent=1))
        print(f"tokens/s: lisaft {ours:,.0f}, HF Trainer {theirs:,.0f} ({ours / theirs:.2f}x)")
    return 0 if ours and theirs else 1


if __name__ == "__main__":
    sys.exit(main())
