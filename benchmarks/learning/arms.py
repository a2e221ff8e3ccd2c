"""One run: an arm fine-tuned at one learning rate and seed, scored along the way.

lisaft arms go through lisaft's public loop (`build_session`, `train_step`), so they train exactly
as `lisaft train` does. The other arms run in a plain loop built from the same pieces: the same
examples, the same batches in the same order (`lisaft.data.order.DataOrder` and `collate`), the same
loss normalisation (sum over response tokens / their count), the same learning-rate curve
(`lisaft.optim.lr_schedule.lr_at`), clipping and AdamW settings.
"""

from __future__ import annotations

import contextlib
import io
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.learning.measure import exact_match, peak_rss_bytes, reset_peak_rss, tensor_bytes, token_accuracy

# name -> how it trains. "lisaft" arms are recipes; the rest are plain loops.
ARMS = {
    "full": {"kind": "lisaft", "lisa": None},
    "lisa_g1": {"kind": "lisaft", "lisa": {"active_layers": 1, "state_policy": "discard"}},
    "lisa_g2": {"kind": "lisaft", "lisa": {"active_layers": 2, "state_policy": "discard"}},
    "lisa_g2_keep": {"kind": "lisaft", "lisa": {"active_layers": 2, "state_policy": "keep"}},
    "emb_head": {"kind": "emb_head"},
    # LoRA through lisaft's own loop (recipe section lora; docs/lora.md), alpha = 2r, every linear layer.
    "lora_r8": {"kind": "lisaft", "lisa": None, "lora": {"rank": 8}},
    "lora_r16": {"kind": "lisaft", "lisa": None, "lora": {"rank": 16}},
    "badam": {"kind": "badam"},
}
# The precision arm: LISA γ=2 (discard) in bfloat16 with each rounding mode, and in float32.
PRECISION_ARMS = {
    "fp32": {"kind": "lisaft", "lisa": ARMS["lisa_g2"]["lisa"], "dtype": "float32"},
    "bf16_stochastic": {"kind": "lisaft", "lisa": ARMS["lisa_g2"]["lisa"], "dtype": "bfloat16",
                        "bf16_update": "stochastic"},
    "bf16_nearest": {"kind": "lisaft", "lisa": ARMS["lisa_g2"]["lisa"], "dtype": "bfloat16",
                     "bf16_update": "nearest"},
}
BETAS, EPS, MAX_GRAD_NORM = (0.9, 0.999), 1e-8, 1.0


@dataclass
class Data:
    tokenizer: object
    new_train: list
    new_eval: list
    old_eval: list


_DATA: dict[str, Data] = {}


def load_data(data_dir: str, tokenizer_dir: str, max_seq_len: int) -> Data:
    """Tokenized task families, read once per process."""
    if data_dir not in _DATA:
        from lisaft.config.schema import DataSection, ModelSection
        from lisaft.data.examples import load_splits
        from lisaft.model.load import load_tokenizer

        tok = load_tokenizer(ModelSection(config="unused", tokenizer=tokenizer_dir))
        d = Path(data_dir)
        sec = lambda fam: DataSection(train=str(d / f"{fam}_train.jsonl"), eval=str(d / f"{fam}_eval.jsonl"),  # noqa: E731
                                      format="instruction", max_seq_len=max_seq_len)
        new_train, new_eval = load_splits(sec("B"), tok, 0)
        _, old_eval = load_splits(sec("A"), tok, 0)
        _DATA[data_dir] = Data(tok, new_train, new_eval, old_eval)
    return _DATA[data_dir]


def lisaft_recipe(job: dict, spec: dict, model_ref: dict, run_dir: Path, max_steps: int, lr: float,
                  preference: dict | None = None, grpo: dict | None = None):
    """The recipe a lisaft arm (or the pre-training) runs; model_ref names the model source; with
    `preference` (the recipe section) it trains on pairs (benchmarks/learning/preference.py), with
    `grpo` (the recipe section) on prompts (benchmarks/learning/protocol4.py)."""
    from lisaft.config.preference_losses import preference_loss
    from lisaft.config.schema import recipe_from_dict

    s = job["settings"]
    lisa = spec.get("lisa")
    optimizer = {"name": "adamw_32bit", "lr": lr, "weight_decay": 0.0, "betas": list(BETAS), "eps": EPS}
    if "bf16_update" in spec:
        optimizer["bf16_update"] = spec["bf16_update"]
    optimizer.update(spec.get("optimizer", {}))  # apollo arms: optimizer.name, optimizer.rank
    lora = spec.get("lora")
    lora_section = {"enabled": True, "alpha": 2 * lora["rank"], "dropout": 0.0, "target_modules": "all-linear",
                    **{k: v for k, v in lora.items() if k != "quantize"}} if lora else {}
    quantize = (lora or {}).get("quantize")
    data_format = preference_loss(preference["loss"]).data_format if preference else "prompts" if grpo \
        else "instruction"
    return recipe_from_dict({
        "model": {**model_ref, "tokenizer": job["tokenizer"], "attention": "sdpa", "quantize": quantize,
                  # a 4-bit base computes in bf16, the dtype QLoRA's adapters train in
                  "dtype": "bfloat16" if quantize else spec.get("dtype", "float32")},
        "data": {"train": "given", "format": data_format, "max_seq_len": s["max_seq_len"]},
        **({"preference": preference} if preference else {}),
        **({"grpo": grpo} if grpo else {}),
        "optimizer": optimizer,
        "scheduler": {"name": "cosine", "warmup_steps": s["warmup_steps"], "min_lr_ratio": 0.1},
        "lisa": {"enabled": lisa is not None, "interval_steps": s["interval_steps"], **(lisa or {})},
        "lora": lora_section,
        "training": {"seed": job["seed"], "batch_size": s["batch_size"], "max_steps": max_steps,
                     "max_grad_norm": MAX_GRAD_NORM, "output_dir": str(run_dir), "device": "cpu",
                     "threads": job.get("threads", "auto")},
    }, f"learning_bench:{job['arm']}")


def pretrain_family_a(work: Path, s: dict, data_dir: Path, tokenizer, tokenizer_ref: str,
                      log_every: int | None = None) -> tuple[torch.nn.Module, float, float]:
    """Family A from random init (work/config.json) with lisaft full fine-tuning, saved with its
    tokenizer as an HF folder in work/pretrained. Both protocols pre-train this way. Returns the
    model, the last step's loss and the perf_counter time training started."""
    from lisaft.config.schema import DataSection
    from lisaft.data.examples import load_splits
    from lisaft.train import build_session, train_step

    a_train, _ = load_splits(DataSection(train=str(Path(data_dir) / "A_train.jsonl"), format="instruction",
                                         max_seq_len=s["max_seq_len"]), tokenizer, 0)
    job = {"arm": "pretrain", "seed": 0, "tokenizer": tokenizer_ref,
           "settings": {**s, "batch_size": s["pretrain_batch_size"], "warmup_steps": s["pretrain_warmup_steps"]}}
    recipe = lisaft_recipe(job, {"lisa": None}, {"config": str(work / "config.json")}, work / "pretrain-run",
                           s["pretrain_steps"], s["pretrain_lr"])
    session = build_session(recipe, work / "pretrain-run", tokenizer=tokenizer, train_examples=a_train,
                            eval_examples=None)
    started = time.perf_counter()
    loss = float("nan")
    for step in range(s["pretrain_steps"]):
        loss = train_step(session, step).loss
        if log_every and (step + 1) % log_every == 0:
            print(f"pre-train step {step + 1}/{s['pretrain_steps']}  loss {loss:.4f}", flush=True)
    session.model.save_pretrained(str(work / "pretrained"))
    tokenizer.save_pretrained(str(work / "pretrained"))
    return session.model, loss, started


class LisaftArm:
    def __init__(self, job: dict, spec: dict, data: Data, run_dir: Path):
        from lisaft.train import build_session

        recipe = lisaft_recipe(job, spec, {"name_or_path": job["pretrained"]}, run_dir,
                               job["settings"]["steps"], job["lr"])
        self.session = build_session(recipe, run_dir, tokenizer=data.tokenizer,
                                     train_examples=data.new_train, eval_examples=data.new_eval)
        self.model = self.session.model

    def step(self, step: int) -> tuple[float, int]:
        from lisaft.train import train_step

        result = train_step(self.session, step)
        self.grad_bytes = result.grad_bytes
        return result.loss, result.tokens

    def memory(self) -> dict:
        resident, offloaded = self.session.optimizers.state_bytes()
        return {"optimizer_state_bytes": resident + offloaded, "grad_bytes": self.grad_bytes,
                "master_copy_bytes": 0}

    def trainable_params(self) -> int:
        return self.session.controller.trainable_params()


class LoopArm:
    """A plain loop over lisaft's batches; subclasses choose what trains and the optimizer."""

    def __init__(self, job: dict, spec: dict, data: Data):
        from transformers import AutoModelForCausalLM

        from lisaft.data.order import DataOrder

        s = job["settings"]
        torch.manual_seed(job["seed"])
        self.model = AutoModelForCausalLM.from_pretrained(job["pretrained"], dtype=torch.float32,
                                                          attn_implementation="sdpa")
        self.data, self.s, self.peak_lr = data, s, job["lr"]
        self.order = DataOrder(len(data.new_train), s["batch_size"], job["seed"])
        self.grad_bytes = 0
        self.optimizer = self.setup(spec, job)

    def setup(self, spec: dict, job: dict):
        raise NotImplementedError

    def _trainable(self) -> list:
        return [p for p in self.model.parameters() if p.requires_grad]

    def step(self, step: int) -> tuple[float, int]:
        from lisaft.data.collate import IGNORE_INDEX, collate
        from lisaft.model.loss import token_loss_sum
        from lisaft.optim.lr_schedule import lr_at

        s = self.s
        lr = lr_at(step, peak_lr=self.peak_lr, max_steps=s["steps"], name="cosine",
                   warmup_steps=s["warmup_steps"], min_lr_ratio=0.1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = collate([self.data.new_train[i] for i in self.order.next_indices()], self.data.tokenizer.pad_token_id)
        n_loss = max(int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()), 1)
        loss = token_loss_sum(self.model, batch)
        (loss / n_loss).backward()
        trainable = self._trainable()
        self.grad_bytes = tensor_bytes(p.grad for p in trainable if p.grad is not None)
        torch.nn.utils.clip_grad_norm_(trainable, MAX_GRAD_NORM)
        self.optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item() / n_loss, int(batch["attention_mask"].sum())

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def _adamw(self, params: list):
        return torch.optim.AdamW(params, lr=self.peak_lr, betas=BETAS, eps=EPS, weight_decay=0.0, fused=True)

    def memory(self) -> dict:
        return {"optimizer_state_bytes": moment_bytes(self.optimizer.state), "grad_bytes": self.grad_bytes,
                "master_copy_bytes": 0}

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self._trainable())


class EmbHeadArm(LoopArm):
    """Embeddings, final norm and LM head train; every decoder layer stays frozen."""

    def setup(self, spec, job):
        from lisaft.model.parts import model_parts

        parts = model_parts(self.model)
        self.model.requires_grad_(False)
        for p in parts.embeddings + parts.head:
            p.requires_grad_(True)
        return self._adamw(self._trainable())


class BadamArm(LoopArm):
    """badam.BlockOptimizer: one block per decoder layer, a new block every K steps in random
    order; embeddings and head stay frozen (BAdam's default). It keeps a float32 master copy of
    the active block (counted as master_copy_bytes)."""

    def setup(self, spec, job):
        from badam import BlockOptimizer

        base = torch.optim.AdamW(self.model.parameters(), lr=self.peak_lr, betas=BETAS, eps=EPS,
                                 weight_decay=0.0)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # "expects bf16 weights": these are float32 on purpose
            return BlockOptimizer(base_optimizer=base, named_parameters_list=list(self.model.named_parameters()),
                                  switch_block_every=self.s["interval_steps"], switch_mode="random", verbose=0)

    def optimizer_step(self) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints every switch
            self.optimizer.step()

    def memory(self) -> dict:
        opt = self.optimizer
        return {"optimizer_state_bytes": moment_bytes(opt.base_optimizer.state),
                "grad_bytes": self.grad_bytes, "master_copy_bytes": tensor_bytes(opt.param_idx2hp.values())}


def moment_bytes(state: dict) -> int:
    """Bytes of the moments in a torch optimizer's state. Its per-tensor float32 step counters are
    left out, as lisaft keeps the step count as a number: both count the same thing."""
    return tensor_bytes(v for st in state.values() for k, v in st.items() if k != "step")


def _make_arm(job: dict, spec: dict, data: Data, run_dir: Path):
    kind = spec["kind"]
    if kind == "lisaft":
        return LisaftArm(job, spec, data, run_dir)
    return {"emb_head": EmbHeadArm, "badam": BadamArm}[kind](job, spec, data)


def scores(model, data: Data, n_eval: int | None, generate: bool) -> dict:
    """Token accuracy (and exact match) on the new task family B and the old one A."""
    pad, eos = data.tokenizer.pad_token_id, data.tokenizer.eos_token_id
    out = {}
    for fam, examples in (("new", data.new_eval), ("old", data.old_eval)):
        ex = examples[:n_eval] if n_eval else examples
        acc = token_accuracy(model, ex, pad)
        out[f"{fam}_token_accuracy"], out[f"{fam}_loss"] = acc["token_accuracy"], acc["loss"]
        if generate:
            out[f"{fam}_exact_match"] = exact_match(model, ex, pad, eos)
    return out


def run_job(job: dict) -> dict:
    """Train one arm at one lr and seed; returns the run record (the JSON's `runs` entry)."""
    import tempfile

    from transformers.utils import logging as hf_logging

    torch.set_num_threads(job["threads"])
    hf_logging.disable_progress_bar()
    s = job["settings"]
    data = load_data(job["data_dir"], job["tokenizer"], s["max_seq_len"])
    spec = (PRECISION_ARMS if job.get("precision") else ARMS)[job["arm"]]
    reset_peak_rss()
    with tempfile.TemporaryDirectory(prefix="learning-bench-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arm = _make_arm(job, spec, data, Path(tmp))
        curve, peaks, tokens, train_s, losses = [], {}, 0, 0.0, []
        for step in range(s["steps"]):
            t0 = time.perf_counter()
            loss, n = arm.step(step)
            train_s += time.perf_counter() - t0
            tokens += n
            losses.append(loss)
            for k, v in arm.memory().items():
                peaks[k] = max(peaks.get(k, 0), v)
            if (step + 1) % s["eval_every"] == 0 or step + 1 == s["steps"]:
                curve.append({"step": step + 1, **scores(arm.model, data, s["curve_examples"], generate=False)})
        final = scores(arm.model, data, s["final_examples"], generate=True)
        rss = peak_rss_bytes()
    return {"arm": job["arm"], "lr": job["lr"], "seed": job["seed"], "steps": s["steps"], "tokens": tokens,
            "train_s": train_s, "tokens_per_s": tokens / train_s, "peak_rss_bytes": rss,
            "trainable_params_last": arm.trainable_params(), **{f"peak_{k}": v for k, v in peaks.items()},
            "train_loss_first": losses[0], "train_loss_last": losses[-1], "curve": curve, "final": final}
