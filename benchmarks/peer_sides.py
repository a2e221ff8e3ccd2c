"""The contenders of benchmarks/peer_bench.py, each run alone in a process of its own: lisaft's
training loop, transformers' Trainer (full fine-tuning, and LISA the LMFlow way: a callback that
toggles requires_grad) and TRL's DPOTrainer with its reference log-probs precomputed.

Every side stamps the wall clock at the end of each optimizer step (lisaft: around the loop's
call of train_step; the Trainer: its on_step_end callback), so the interval between two stamps is
all a step costs, the loop's own per-step work (guards, logging) included. With `profile`, the
steps after the warm-up run under torch.profiler and the side reports its top operators.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from benchmarks.common import PadOnly, hf_in_order, lmflow_style_switch, synthetic_examples

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "recipes" / "quickstart" / "tokenizer"
SEED, LR, MAX_GRAD_NORM, GAMMA, BETA = 0, 1e-4, 1.0, 2, 0.1
PROFILED_STEPS = 3


class Stamps:
    """Step-end times; with `profile`, torch.profiler over PROFILED_STEPS steps after `warmup`."""

    def __init__(self, warmup: int, profile: bool) -> None:
        self.t: list[float] = []
        self.cpu: list[float] = []  # the process's CPU time, every thread: less moved by other work than wall time
        self.warmup, self.profile = warmup, profile
        self.prof = None
        self.top: list[dict] = []
        self.matmuls: list[dict] = []

    def step_ended(self) -> None:
        self.t.append(time.perf_counter())
        self.cpu.append(time.process_time())
        n = len(self.t)
        if self.profile and n == self.warmup:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self.prof.__enter__()
        elif self.prof is not None and n == self.warmup + PROFILED_STEPS:
            self.prof.__exit__(None, None, None)
            self.top = top_ops(self.prof, PROFILED_STEPS)
            self.matmuls = matmuls_by_shape(self.prof, PROFILED_STEPS)
            self.prof = None

    def result(self) -> dict:
        w = self.warmup
        steps = len(self.t) - w
        span = self.t[-1] - self.t[w - 1] if steps > 0 else float("nan")
        gaps = sorted(b - a for a, b in zip(self.t[w - 1:], self.t[w:]))
        return {"steps_timed": steps, "step_s_mean": span / steps, "step_s_median": gaps[len(gaps) // 2],
                "steps_per_s": steps / span, "cpu_s_per_step": (self.cpu[-1] - self.cpu[w - 1]) / steps,
                **({"profile_top_ops": self.top, "profile_matmuls": self.matmuls} if self.profile else {})}


def top_ops(prof, steps: int, n: int = 20) -> list[dict]:
    """The operators with the most self CPU time, each as a share of the profiled steps' total."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
             "share": e.self_cpu_time_total / total} for e in rows[:n]]


MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm")


def matmuls_by_shape(prof, steps: int) -> list[dict]:
    """Each matmul operator's self CPU time a step by its operands' shapes: the decoder layers'
    matmuls (the same shapes on every side) apart from the head's, which differ where the loss
    runs in chunks."""
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in MATMULS]
    rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "shapes": str(e.input_shapes), "calls_per_step": e.count / steps,
             "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in rows]


# ---------------------------------------------------------------------------------------------
# Data: the same rows for every side


def sft_examples(s: dict, vocab: int) -> list[dict]:
    return synthetic_examples(s["steps"] * s["batch_size"], s["seq_len"], vocab, SEED)


def preference_rows(n: int) -> list[dict]:
    """Pairs of strings of varied length (a real pair batch is padded): sort a word's letters."""
    rng = random.Random(SEED)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(8, 40)))
        wrong = list(word)
        rng.shuffle(wrong)
        rows.append({"prompt": f"Sort the letters of {word}: ", "chosen": "".join(sorted(word)),
                     "rejected": "".join(wrong) + "x"})
    return rows


def model_config(shape: dict, work: Path, seq_len: int) -> Path:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "max_position_embeddings": seq_len, **shape}
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(cfg))
    return work / "model"


# ---------------------------------------------------------------------------------------------
# lisaft


def _lisaft_run(recipe, run_dir: Path, stamps: Stamps, **session_kw) -> None:
    """`lisaft train`'s loop on the recipe, with the step ends stamped. The recipe runs one step
    more than timed and the loop stops as at a signal before it: the run ends with a checkpoint
    but no export (which needs a tokenizer that saves)."""
    import lisaft.train.loop as loop
    from lisaft import run_folder
    from lisaft.train import build_session

    session = build_session(recipe, run_dir, **session_kw)
    run_folder.make_run_dir(run_dir)
    session.controller.activate_for_step(0)
    inner = loop.train_step

    def stamped(*args, **kwargs):
        result = inner(*args, **kwargs)
        stamps.step_ended()
        return result

    loop.train_step = stamped
    try:
        loop.run(session, base=None, show=False, stop_at=recipe.training.max_steps - 1)
    finally:
        loop.train_step = inner


def lisaft_side(name: str, s: dict, work: Path, stamps: Stamps) -> dict:
    from lisaft.config.schema import recipe_from_dict

    model = ({"name_or_path": s["model_path"]} if s.get("model_path")
             else {"config": str(model_config(s["model"], work, s["seq_len"]))})
    training = {"seed": SEED, "batch_size": s["batch_size"], "max_steps": s["steps"] + 1,
                "max_grad_norm": MAX_GRAD_NORM, "log_every": s["log_every"], "output_dir": str(work / "run"),
                "device": "cpu", "compile": name.endswith("_compiled")}
    common = {"optimizer": {"name": "adamw_32bit", "lr": LR, "weight_decay": 0.0},
              "scheduler": {"name": "constant", "warmup_steps": 0}, "training": training}
    if name == "lisaft_dpo":
        data = work / "pairs.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in preference_rows(s["steps"] * s["batch_size"])))
        recipe = recipe_from_dict({
            "model": {**model, "tokenizer": s.get("tokenizer") or str(TOKENIZER), "dtype": "float32",
                      "attention": "sdpa"},
            "data": {"train": str(data), "format": "preference", "max_seq_len": s["seq_len"]},
            "preference": {"loss": "dpo", "beta": BETA}, **common}, "peer_bench")
        _lisaft_run(recipe, work / "run", stamps)
    else:
        recipe = recipe_from_dict({
            "model": {**model, "tokenizer": "unused", "dtype": "float32", "attention": "sdpa"},
            "data": {"train": "unused", "max_seq_len": s["seq_len"], "packing": True},
            "lisa": {"enabled": name.startswith("lisaft_lisa"), "active_layers": GAMMA,
                     "interval_steps": s["interval"]},
            **common}, "peer_bench")
        _lisaft_run(recipe, work / "run", stamps, tokenizer=PadOnly(), train_examples=sft_examples(s, s["vocab"]),
                    eval_examples=None)
    return stamps.result()


# ---------------------------------------------------------------------------------------------
# transformers' Trainer and TRL


def _model(s: dict, work: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEED)  # lisaft draws a model.config's initial weights from training.seed
    if s.get("model_path"):
        return AutoModelForCausalLM.from_pretrained(s["model_path"], dtype=torch.float32, attn_implementation="sdpa")
    config = AutoConfig.from_pretrained(str(model_config(s["model"], work, s["seq_len"])))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _callbacks(stamps: Stamps, lmflow: bool, layers, interval: int) -> list:
    from transformers import TrainerCallback

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.step_ended()

    class LMFlowStyleLisa(TrainerCallback):
        """Every `interval` steps the reference switch (benchmarks/common.py)."""

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step % interval == 0:
                lmflow_style_switch(layers, GAMMA)

    return [Stamp(), LMFlowStyleLisa()] if lmflow else [Stamp()]


def _args(s: dict, work: Path) -> dict:
    return dict(output_dir=str(work / "out"), per_device_train_batch_size=s["batch_size"], max_steps=s["steps"],
                learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=MAX_GRAD_NORM, optim="adamw_torch_fused", seed=SEED, use_cpu=True, save_strategy="no",
                logging_steps=s["log_every"], report_to=[], disable_tqdm=True, dataloader_num_workers=0)


def hf_side(name: str, s: dict, work: Path, stamps: Stamps) -> dict:
    from transformers import TrainingArguments

    from lisaft.data.order import DataOrder

    model = _model(s, work)
    model.config.use_cache = False
    rows = sft_examples(s, s["vocab"])
    order = DataOrder(len(rows), s["batch_size"], SEED)  # lisaft's batches, step for step
    ordered = [rows[i]["input_ids"] for _ in range(s["steps"]) for i in order.next_indices()]

    rows_in_order, InOrder = hf_in_order(ordered)
    callbacks = _callbacks(stamps, name.startswith("hf_lmflow"), model.model.layers, s["interval"])
    args = TrainingArguments(**_args(s, work), remove_unused_columns=False, torch_compile=name.endswith("_compiled"))
    InOrder(model=model, args=args, train_dataset=rows_in_order, callbacks=callbacks).train()
    return stamps.result()


def trl_side(s: dict, work: Path, stamps: Stamps) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(s.get("tokenizer") or str(TOKENIZER))
    model = _model(s, work)
    args = DPOConfig(**_args(s, work), beta=BETA, max_length=s["seq_len"], precompute_ref_log_probs=True)
    rows = Dataset.from_list(preference_rows(s["steps"] * s["batch_size"]))
    DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
               callbacks=_callbacks(stamps, False, None, 0)).train()
    return stamps.result()


def run_side(name: str, s: dict, work: Path, profile: bool) -> dict:
    import torch

    torch.set_num_threads(s["threads"])
    stamps = Stamps(s["warmup"], profile)
    if name.startswith("lisaft_"):
        return lisaft_side(name, s, work, stamps)
    if name == "trl_dpo":
        return trl_side(s, work, stamps)
    return hf_side(name, s, work, stamps)
