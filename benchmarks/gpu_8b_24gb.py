"""The GPU suite: Llama-3.1-8B under a 24 GiB cap, measured against the estimator.

Each configuration runs in a fresh subprocess whose PyTorch allocator is capped at 24 GiB less
the NVML-used bytes of its bare CUDA context (torch.cuda.set_per_process_memory_fraction), trained
by lisaft's own trainer (`build_session` + `train_step`) on synthetic token rows, with the model
built from the shipped Llama-3.1-8B config with random bf16 weights directly on the GPU (nothing
downloaded, nothing on the CPU first): packed rows of four documents each, or preference pairs
whose rejected answer is shorter, so attention gets the masks the estimate counts. Most
important first, so a time budget (--budget-s) cuts the least important; each run's expected
time is computed (benchmarks/gpu_times.py):

  lisa-8b             recipes/llama3.1-8b-lisa-24gb.yaml re-sampling every 4 steps: layer
                      switches inside the timed steps
  headroom            recipes/llama3.1-8b-lisa-24gb.yaml as shipped (expandable segments,
                      model.offload_activations)
  long-16k            recipes/llama3.1-8b-lisa-16k-24gb.yaml (16,384 tokens, offloaded
                      checkpoints, chunked MLP)
  shipped-default-alloc  the 24 GiB recipe with PyTorch's default allocator: the baseline the
                      estimator's 9% reserve and kernel-image term were fitted to
  compiled            the 24 GiB recipe with training.compile: true (tokens/s, FLOP share)
  full-in-backward    full fine-tuning, paged AdamW 8-bit stepped in backward, no clipping
  offload-full-ga4 / -ga8 / -ga32   recipes/llama3.1-8b-full-24gb.yaml: full fine-tuning with
                      the optimizer on the CPU (optimizer.cpu_offload), layer-major
                      (offload_accumulation: device), at 4 (on the recipe's dense embedding
                      gradient), 8 and 32 micro-batches per step: tokens/s, NVML peak, the host's
                      peak RSS, the step's parts (benchmarks/step_parts.py: transfers,
                      accumulation, host step) and its counted transfers and host additions
  offload-host-ga4    the same at 4 micro-batches with offload_accumulation: host, one step
  apollo-r32-8b       the same recipe with its header's APOLLO at rank 32, channel scaling
  dpo-8b / lora-dpo-8b   recipes/llama3.1-8b-dpo-24gb.yaml (every weight, optimizer on the CPU, 2
                      pairs a step) and recipes/llama3.1-8b-lora-dpo-24gb.yaml (8,192 tokens a
                      sequence, one pair a step), DPO's reference pass first
  grpo-8b             recipes/llama3.1-8b-grpo-24gb.yaml (every weight, optimizer on the CPU, β 0,
                      G 8) at one generation a step: NVML's peak and tokens/s of the generation and
                      of the training apart
  apollo-8b           recipes/llama3.1-8b-apollo-24gb.yaml as shipped (APOLLO-Mini, every weight,
                      stepped in backward): its NVML peak against its estimate
  lora-8b / qlora-8b  recipes/llama3.1-8b-lora-24gb.yaml (16,384 tokens) and
                      recipes/llama3.1-8b-qlora-24gb.yaml (32,768 tokens, NF4 base quantized on
                      the GPU from the random weights), one micro-batch a step
  table-g2-s8192 / offload-8k   plain against offloaded checkpoints at 8,192 tokens (tokens/s)
  table-gG-sS         the estimator-error table, γ in {1, 2, 4} x seq in {512, 2048, 8192}
                      (table-g2-s2048 is the recipe as shipped)

For each it records NVML-used (polled every 20 ms: the only counter that sees the CUDA context,
kernel images and paged optimizer state), the allocator's peak allocated and reserved bytes,
tokens/s and their share of the FLOP bound (matmul FLOPs per token, counted as lisa_bench.py
counts them, times tokens/s, over the device's measured bf16 matmul rate), the estimate for the
same settings and its error, and what NVML saw beyond reserved + paged state + the bare context
(the estimator's `cuda_kernels` term). JSON is rewritten after
every configuration, so a run cut short keeps what it measured; a markdown copy of the tables
goes beside it for docs/memory.md.

    python -m benchmarks.gpu_8b_24gb --budget-s 420      # on a CUDA machine
    python -m benchmarks.gpu_8b_24gb --tiny              # same code path, CPU, tiny shapes (tested)
    benchmarks/gpu_run.sh                                # carried wheels + the suite, results in $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import gpu_box
from benchmarks.common import (
    IdsTokenizer,
    PadOnly,
    synthetic_documents,
    synthetic_examples,
    synthetic_pairs,
    synthetic_prompts,
)
from benchmarks.gpu_times import in_sequence, recipe_values, run_seconds
from benchmarks.step_parts import StepParts

REPO = Path(__file__).resolve().parents[1]

RECIPE = REPO / "recipes" / "llama3.1-8b-lisa-24gb.yaml"
RECIPE_16K = REPO / "recipes" / "llama3.1-8b-lisa-16k-24gb.yaml"
RECIPE_FULL = REPO / "recipes" / "llama3.1-8b-full-24gb.yaml"
RECIPE_APOLLO = REPO / "recipes" / "llama3.1-8b-apollo-24gb.yaml"
RECIPE_LORA = REPO / "recipes" / "llama3.1-8b-lora-24gb.yaml"
RECIPE_QLORA = REPO / "recipes" / "llama3.1-8b-qlora-24gb.yaml"
RECIPE_DPO = REPO / "recipes" / "llama3.1-8b-dpo-24gb.yaml"
RECIPE_LORA_DPO = REPO / "recipes" / "llama3.1-8b-lora-dpo-24gb.yaml"
RECIPE_GRPO = REPO / "recipes" / "llama3.1-8b-grpo-24gb.yaml"
CONFIG_8B = REPO / "lisaft" / "memory" / "catalogue" / "llama-3.1-8b.json"
GiB = 1024**3
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
DEFAULT_ALLOC = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}

# Every switch of the real runs, on a model and sequences a laptop CPU trains in seconds.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
TINY_SEQ = {512: 32, 1536: 48, 2048: 64, 8192: 96, 16384: 128, 32768: 160}
TINY_MLP_CHUNK = 32


OFFLOAD_GA4 = ("training.grad_accum_steps=4", "model.sparse_embedding_grad=false")
PEER = ("training.grad_accum_steps=1", "data.max_seq_len=2048", "model.offload_activations=false",
        "model.mlp_chunk_tokens=null", "training.max_grad_norm=null", "scheduler.name=constant",
        "scheduler.warmup_steps=0")


@dataclass(frozen=True)
class Config:
    name: str
    recipe: Path = RECIPE
    overrides: tuple = ()
    env: dict = field(default_factory=lambda: dict(EXPANDABLE))
    steps: int = 10
    gamma: int | None = None  # set for the estimator-error table's cells
    seq: int | None = None
    tiny_steps: int = 3  # steps in the dry run
    # Random weights saved as a pretrained folder first (model.quantize refuses model.config).
    pretrained: bool = False

    @property
    def expected(self) -> dict:
        """Wall time on the lent H200, start-up included, with its parts (benchmarks/gpu_times.py)."""
        return run_seconds(self.recipe, self.overrides, self.steps, CONFIG_8B)


def _table_cell(gamma: int, seq: int, steps: int = 4) -> Config:
    return Config(f"table-g{gamma}-s{seq}", overrides=(f"lisa.active_layers={gamma}", f"data.max_seq_len={seq}"),
                  steps=steps, gamma=gamma, seq=seq)


CONFIGS = [
    # The LISA recipe as shipped, re-sampling every 4 steps: two layer switches fall inside the
    # timed steps (from the third on), so tokens/s and the NVML peak include what a switch costs.
    Config("lisa-8b", overrides=("lisa.interval_steps=4",), steps=12, tiny_steps=5),
    Config("headroom", steps=12),  # the recipe as shipped
    _table_cell(2, 2048, steps=10),  # the same, for the table
    Config("long-16k", recipe=RECIPE_16K, steps=6),
    Config("shipped-default-alloc", env=dict(DEFAULT_ALLOC), steps=12),
    # training.compile on CUDA (regional: two graphs serve every layer): tokens/s against the
    # recipe as shipped; the first steps include compiling, which _derive leaves out.
    Config("compiled", overrides=("training.compile=true",), steps=12),
    Config("full-in-backward", overrides=("lisa.enabled=false", "optimizer.in_backward=true",
                                          "training.max_grad_norm=null"), steps=8),
    # recipes/llama3.1-8b-full-24gb.yaml at 4 micro-batches a step (the step's parts are the
    # recipe's, 8 times fewer micro-batches to time), then at 8 and 32. Step times are averaged
    # from the third step on (_derive): three steps each.
    # The recipe's own 32 micro-batches of 2,048 tokens (65,536 a step) take the dense embedding
    # gradient (sparse pays under half the vocabulary's tokens a step: model/load.py); at 4 the
    # sparse path would run, which the recipe never takes, so the run keeps the recipe's.
    # Both accumulation paths at that shape: `device` (the layer-major backward, the recipe's
    # default) against `host` (every micro-batch's gradient shipped and added on the host), one
    # step of it: its tokens/s then includes the first step's warm-up.
    Config("offload-full-ga4", recipe=RECIPE_FULL,
           overrides=(*OFFLOAD_GA4, "optimizer.offload_accumulation=device"), steps=2, tiny_steps=3),
    Config("offload-host-ga4", recipe=RECIPE_FULL, overrides=(*OFFLOAD_GA4, "optimizer.offload_accumulation=host"),
           steps=1, tiny_steps=3),
    Config("offload-full-ga8", recipe=RECIPE_FULL, overrides=("training.grad_accum_steps=8",), steps=3),
    Config("offload-full-ga32", recipe=RECIPE_FULL, overrides=("training.grad_accum_steps=32",), steps=3),
    Config("apollo-8b", recipe=RECIPE_APOLLO, steps=8),
    # The recipe header's APOLLO at rank 32 with channel scaling (21.40 GiB estimated).
    Config("apollo-r32-8b", recipe=RECIPE_APOLLO, overrides=("optimizer.name=apollo", "optimizer.rank=32",
                                                            "optimizer.scale=1", "optimizer.scale_type=channel"),
           steps=8),
    # The preference recipes (README: 20.96 GiB full-parameter DPO with the optimizer on the CPU,
    # 19.63 GiB LoRA-DPO at 8,192 tokens a sequence), DPO's reference pass included: full DPO at 2
    # pairs a step (the recipe's 32 pay the same peak, 16 times the host time), LoRA-DPO at one.
    Config("dpo-8b", recipe=RECIPE_DPO, overrides=("training.grad_accum_steps=2",), steps=2, tiny_steps=3),
    Config("lora-dpo-8b", recipe=RECIPE_LORA_DPO, overrides=("training.grad_accum_steps=1",), steps=2,
           tiny_steps=3),
    # The GRPO recipe (README: 18.31 GiB at its generation, the KV cache of 8 sequences of 512 +
    # 1,024 tokens; 18.27 GiB training) at one generation a step (its 4 micro-batches; the recipe's
    # 16 hold the same peaks, four generations): each phase's NVML peak and tokens/s apart.
    Config("grpo-8b", recipe=RECIPE_GRPO, overrides=("training.grad_accum_steps=4",), steps=1, tiny_steps=3),
    # The LoRA and QLoRA recipes at their shipped lengths (16,384 and 32,768 tokens), one
    # micro-batch a step: the peak is a micro-batch's, the adapters' gradients are small.
    Config("lora-8b", recipe=RECIPE_LORA, overrides=("training.grad_accum_steps=1",), steps=3),
    Config("qlora-8b", recipe=RECIPE_QLORA, overrides=("training.grad_accum_steps=1",), steps=1, pretrained=True),
    # lisaft's side of the peer comparison (benchmarks/gpu_peer.py): the LoRA recipe at 2,048
    # tokens, one row a step, as HF Trainer runs the same.
    Config("peer-lisaft", recipe=RECIPE_LORA, overrides=PEER, steps=8),
    _table_cell(2, 8192, steps=6),
    Config("offload-8k", overrides=("data.max_seq_len=8192", "model.offload_activations=true"), steps=6),
    *[_table_cell(g, s) for g, s in ((1, 512), (4, 2048), (1, 8192), (4, 8192), (2, 512), (4, 512), (1, 2048))],
]
BY_NAME = {c.name: c for c in CONFIGS}


class NvmlPeak:
    """Polls the device's NVML-used memory in a thread (torch maps the device index to NVML's)."""

    def __init__(self, interval_s: float = 0.02):
        import torch

        self.peak = None
        self.phase: str | None = None  # set by the run: each phase's peak is kept apart too
        self.phase_peaks: dict[str, int] = {}
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._ok = torch.cuda.is_available() and self.read() is not None

    @staticmethod
    def read() -> int | None:
        from lisaft.metrics.measure import nvml_used_bytes

        return nvml_used_bytes("cuda:0")

    def __enter__(self):
        if self._ok:
            self.peak = self.read()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval_s)

    def sample(self) -> None:
        now = self.read()
        self.peak = max(self.peak, now)
        if self.phase is not None:
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), now)

    def enter(self, phase: str) -> None:
        """From now on the samples count for `phase` (a last sample closes the one before)."""
        if self._ok:
            self.sample()
        self.phase = phase

    def __exit__(self, *exc):
        self._stop.set()
        if self._ok:
            self._thread.join()
            self.peak = max(self.peak, self.read())


def _overrides(cfg: Config, tiny: bool, workdir: Path, cuda: bool) -> list[str]:
    if tiny:
        config_path = workdir / "tiny-config.json"
        config_path.write_text(json.dumps(TINY_CONFIG))
    else:
        config_path = CONFIG_8B
    model = ([f"model.name_or_path={_random_weights(config_path, workdir, cuda, tiny)}", "model.config=null"]
             if cfg.pretrained else ["model.name_or_path=null", f"model.config={config_path}"])
    out = [*model, "model.tokenizer=unused",
           f"training.output_dir={workdir / cfg.name}", f"training.max_steps={cfg.steps}",
           f"training.device={'cuda' if cuda else 'cpu'}", *cfg.overrides]
    from lisaft.model.load import flash_attn_available

    if not (cuda and flash_attn_available()):
        out.append("model.attention=sdpa")  # the same tensors as FlashAttention 2 (docs/memory.md)
    if tiny:
        out.append("model.dtype=float32")
        for o in list(out):  # scale every sequence length down, the recipe's own included
            if o.startswith("data.max_seq_len="):
                out.remove(o)
        shipped = recipe_values(cfg.recipe, cfg.overrides)
        out.append(f"data.max_seq_len={TINY_SEQ[shipped['data']['max_seq_len']]}")
        if shipped.get("grpo"):  # the same share of each sequence for the completion
            seq = shipped["data"]["max_seq_len"]
            out.append(f"grpo.max_completion_length={TINY_SEQ[seq] * shipped['grpo']['max_completion_length'] // seq}")
        if shipped["model"].get("mlp_chunk_tokens"):
            out.append(f"model.mlp_chunk_tokens={TINY_MLP_CHUNK}")
    return out


def _config_of(recipe) -> Path:
    return Path(recipe.model.config) if recipe.model.config else Path(recipe.model.name_or_path) / "config.json"


def _random_weights(config_path: Path, workdir: Path, cuda: bool, tiny: bool) -> Path:
    """A pretrained folder of random weights, built on the device and saved once per workdir."""
    folder = workdir / ("random-tiny" if tiny else "random-8b")
    if not (folder / "config.json").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("cuda" if cuda else "cpu"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_path)),
                                                     dtype=torch.float32 if tiny else torch.bfloat16)
        model.save_pretrained(folder)
        del model
        if cuda:
            torch.cuda.empty_cache()
    return folder


def _generation_apart(session, nvml: NvmlPeak, cuda: bool, result: dict) -> None:
    """GRPO: every generation of a step is sampled in the objective's step_batches, before the
    step's first micro-batch trains (lisaft/train/objectives/grpo.py): timed there, its sampled
    tokens counted (every row to the width the longest ran to) and NVML's peak kept apart. Under
    cpu_offload the last step's CPU step is waited for first: the generation's first forward would
    wait for it, and that time is the training's."""
    import torch

    inner = session.objective.step_batches

    def step_batches(model, step, examples):
        session.optimizers.wait()
        nvml.enter("generation")
        t0 = time.perf_counter()
        made = inner(model, step, examples)
        if cuda:
            torch.cuda.synchronize()
        result["generation_s"].append(time.perf_counter() - t0)
        result["generated_tokens"].append(sum(b["completion_mask"].numel() for b in made.batches))
        nvml.enter("training")
        return made

    session.objective.step_batches = step_batches
    result.update(generation_s=[], generated_tokens=[])


def _train(session, steps: int, cuda: bool, result: dict, partial: Path | None, nvml: NvmlPeak) -> None:
    """The trainer's own step, timed, its parts too (benchmarks/step_parts.py); the one place
    that knows the trainer's API. The result so far goes to `partial` after every step."""
    import torch

    from lisaft.train import train_step

    if session.recipe.grpo is not None:
        _generation_apart(session, nvml, cuda, result)
    parts = StepParts(cuda)
    offloaded = getattr(session.parallel, "offloaded", None)
    if offloaded is not None:
        parts.instrument_offload(offloaded)
        result["offload_parts_timed"] = parts.timed
    for step in range(steps):
        t0 = time.perf_counter()
        stepped = train_step(session, step, phases=parts)
        loss, tokens = stepped.loss, stepped.tokens
        if cuda:
            torch.cuda.synchronize()
        result["step_times_s"].append(time.perf_counter() - t0)
        result["step_parts"].append(parts.take())
        result["active_layers"].append(list(session.controller.active_layers) if result["lisa"] else None)
        result.update(steps_done=step + 1, last_loss=loss, tokens_per_step=tokens)
        if stepped.offload is not None:  # the step's counted transfers and host additions
            result["offload_counts"] = stepped.offload
        if cuda:
            result["torch_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        if partial is not None:
            partial.write_text(json.dumps(result))
    result["optimizer_state_bytes"], result["offloaded_state_bytes"] = session.optimizers.state_bytes()


def cap_allocator(budget: int) -> int:
    """Cap PyTorch's allocator at the budget less what NVML shows once the context exists (a
    24 GB card holds the context too); returns that baseline."""
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.reset_peak_memory_stats()  # a random-weights folder built before does not count
    baseline = NvmlPeak.read() or 0
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(max(0.0, min(1.0, (budget - baseline) / total)), 0)
    return baseline


def one_run(cfg: Config, tiny: bool, cap_gib: float, workdir: Path, partial: Path | None = None) -> dict:
    """Train one configuration in this process; returns its measurements."""
    import torch

    from lisaft.config.compat import offload_accumulation
    from lisaft.config.schema import load_recipe
    from lisaft.memory.command import estimate_for_recipe
    from lisaft.metrics.measure import peak_rss_bytes
    from lisaft.train import build_session

    cuda = torch.cuda.is_available() and not tiny
    recipe = load_recipe(cfg.recipe, _overrides(cfg, tiny, workdir, cuda))
    t = recipe.training
    budget = int(cap_gib * GiB)
    est = estimate_for_recipe(recipe, device="cuda" if cuda else "cpu", budget_bytes=budget)
    result = {"run": cfg.name, "overrides": list(cfg.overrides), "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "gamma": recipe.lisa.active_layers if recipe.lisa.enabled else None,
              "attention": recipe.model.attention, "optimizer": recipe.optimizer.name,
              "in_backward": recipe.optimizer.in_backward, "lisa": recipe.lisa.enabled,
              "lora": recipe.lora.enabled, "quantize": recipe.model.quantize,
              "preference": recipe.preference.loss if recipe.preference is not None else None,
              "packing": recipe.data.packing,
              "offload_activations": recipe.model.offload_activations, "seq_len": recipe.data.max_seq_len,
              "batch_size": t.batch_size, "cap_bytes": budget, "estimated_total_bytes": est.total_bytes,
              "estimated_comparable_bytes": est.comparable_peak_bytes, "estimated_components": est.components,
              "estimated_paged_state_bytes": est.paged_state_bytes,
              "estimated_activation_host_bytes": est.activation_host_bytes,
              "cpu_offload": recipe.optimizer.cpu_offload, "grad_accum_steps": t.grad_accum_steps,
              "offload_accumulation": offload_accumulation(recipe),
              "estimated_host_bytes": est.host_bytes, "expected": cfg.expected,
              "steps_planned": cfg.steps, "steps_done": 0, "oom": False, "step_times_s": [], "step_parts": [],
              "active_layers": []}
    if cuda:
        result["nvml_baseline_bytes"] = cap_allocator(budget)  # the context alone
        result["allocator_cap_bytes"] = budget - result["nvml_baseline_bytes"]
    examples = _examples(recipe, cfg.steps * t.batch_size * t.grad_accum_steps)
    with NvmlPeak() as nvml:
        try:
            nvml.enter("setup")
            (workdir / cfg.name).mkdir(parents=True, exist_ok=True)  # GRPO logs completions into it
            session = build_session(recipe, workdir / cfg.name,
                                    tokenizer=IdsTokenizer() if recipe.grpo is not None else PadOnly(),
                                    train_examples=examples, eval_examples=None)
            _train(session, cfg.steps, cuda, result, partial, nvml)
        except torch.OutOfMemoryError as e:
            result.update(oom=True, oom_message=str(e).splitlines()[0])
    result["nvml_peak_used_bytes"] = nvml.peak
    if recipe.grpo is not None:
        result.update(nvml_phase_peak_bytes=nvml.phase_peaks, estimated_phases=est.phases)
    result["peak_rss_bytes"] = peak_rss_bytes()  # host memory: pinned offload buffers show here
    if cuda:
        result["torch_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        result["torch_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    # After the peaks are read: the rate's 8192 x 8192 products must not count in them.
    result.update(_flop_bound(recipe, cuda))
    _derive(result, cuda)
    return result


def _examples(recipe, rows: int) -> list[dict]:
    """What the recipe trains on, as the estimate assumes it: pairs for a preference recipe, rows
    of several documents for a packing one (the block-diagonal mask), else whole rows."""
    vocab = json.loads(_config_of(recipe).read_text())["vocab_size"]
    seq, seed = recipe.data.max_seq_len, recipe.training.seed
    if recipe.preference is not None:
        return synthetic_pairs(rows, seq, vocab, seed)
    if recipe.grpo is not None:  # prompts at their longest, each sampled G times a generation
        return synthetic_prompts(rows, seq - recipe.grpo.max_completion_length, vocab, seed)
    if recipe.data.packing:
        return synthetic_documents(rows, seq, vocab, seed)
    return synthetic_examples(rows, seq, vocab, seed)


def _flop_bound(recipe, cuda: bool) -> dict:
    """Matmul FLOPs per token of this configuration (lisa_bench's count: LISA's γ layers take
    weight gradients, checkpointed layers run forward twice) and the device's measured matmul
    rate in the model's dtype (bf16 on CUDA: the bf16 FLOP bound)."""
    import torch

    from benchmarks.lisa_bench import flops_per_token, matmul_flops_per_s, param_counts

    cfg = json.loads(_config_of(recipe).read_text())
    lisa = recipe.lisa
    active = [list(range(lisa.active_layers))] if lisa.enabled else None
    flops = flops_per_token(param_counts(_config_of(recipe)), cfg, recipe.data.max_seq_len, active,
                            train_embeddings=not lisa.enabled or lisa.train_embeddings,
                            recompute=recipe.model.gradient_checkpointing)
    try:
        rate = (matmul_flops_per_s(torch.get_num_threads(), n=8192, device="cuda", dtype=torch.bfloat16) if cuda
                else matmul_flops_per_s(torch.get_num_threads(), n=512))
    except torch.OutOfMemoryError:  # the model still fills the cap after an OOM'd run
        rate = None
    return {"flops_per_token": flops, "matmul_flops_per_s": rate}


def _derive(r: dict, cuda: bool) -> None:
    times = r["step_times_s"][2:] or r["step_times_s"]  # the first steps warm kernels up
    if times:
        r["step_time_s"] = sum(times) / len(times)
        r["tokens_per_s"] = r.get("tokens_per_step", 0) / r["step_time_s"]
    if r.get("generation_s"):  # GRPO: sampling and training apart, over every step
        sampling, total = sum(r["generation_s"]), sum(r["step_times_s"])
        r["generation_tokens_per_s"] = sum(r["generated_tokens"]) / sampling
        r["training_tokens_per_s"] = r["tokens_per_step"] * len(r["step_times_s"]) / max(total - sampling, 1e-9)
        if r.get("flops_per_token") and r.get("matmul_flops_per_s"):
            r["share_of_flop_bound"] = r["tokens_per_s"] * r["flops_per_token"] / r["matmul_flops_per_s"]
    measured = r["nvml_peak_used_bytes"] if cuda else r["peak_rss_bytes"]
    if measured:
        r["estimate_error"] = r["estimated_total_bytes"] / measured - 1
    if cuda and r.get("nvml_peak_used_bytes"):
        # The allocator's cap leaves out the context; kernel images loaded later and paged state
        # still sit outside it. Paged state is what unified memory may evict under pressure: the
        # peak without it is what a 24 GB card must hold resident.
        r["nvml_over_24gib"] = r["nvml_peak_used_bytes"] > 24 * GiB
        if r.get("estimated_paged_state_bytes"):
            r["resident_without_paged_bytes"] = r["nvml_peak_used_bytes"] - r["estimated_paged_state_bytes"]
            r["resident_without_paged_over_24gib"] = r["resident_without_paged_bytes"] > 24 * GiB
    if cuda and r.get("nvml_peak_used_bytes") and r.get("nvml_baseline_bytes") is not None:
        # What NVML saw beyond the allocator's reserve, paged state and the bare context: the
        # estimator's cuda_kernels term (lazily loaded kernel images, library state).
        r["beyond_reserved_paged_context_bytes"] = (r["nvml_peak_used_bytes"] - r["torch_peak_reserved_bytes"]
                                                    - r["estimated_paged_state_bytes"] - r["nvml_baseline_bytes"])
        r["reserved_over_allocated"] = r["torch_peak_reserved_bytes"] / max(1, r["torch_peak_allocated_bytes"]) - 1
        r["reserved_paged_error"] = r["estimated_comparable_bytes"] / (
            r["torch_peak_reserved_bytes"] + r["estimated_paged_state_bytes"]) - 1


def _g(v) -> str:
    return "-" if v is None else f"{v / GiB:.2f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.1%}"


def tables(results: list[dict]) -> str:
    rows = ["| run | steps | OOM | torch alloc GiB | torch reserved GiB | NVML used GiB | estimate GiB | error "
            "| tokens/s | of FLOP bound |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    over = [r["run"] for r in results if r.get("nvml_over_24gib")]
    for r in results:
        if r.get("skipped") or r.get("error"):
            rows.append(f"| {r['run']} | {r.get('skipped') or r.get('error')} | | | | | | | | |")
            continue
        share = r.get("share_of_flop_bound")
        rows.append(f"| {r['run']} | {r['steps_done']}/{r['steps_planned']} | {r['oom']} | "
                    f"{_g(r.get('torch_peak_allocated_bytes'))} | {_g(r.get('torch_peak_reserved_bytes'))} | "
                    f"{_g(r.get('nvml_peak_used_bytes'))} | {_g(r.get('estimated_total_bytes'))} | "
                    f"{_pct(r.get('estimate_error'))} | {r.get('tokens_per_s', 0):.0f} | "
                    f"{'-' if share is None else f'{share:.0%}'} |")
    if over:
        rows += ["", "NVML peak over 24 GiB (would not fit a 24 GB card): " + ", ".join(over)]
    cells = {(r["gamma"], r["seq_len"]): r for r in results
             if r["run"].startswith("table-") and r.get("steps_done")}
    if cells:
        rows += ["", "Estimator error against NVML-used (γ x seq):", "",
                 "| γ | seq | NVML used GiB | estimate GiB | error | reserved + paged vs estimate |",
                 "| --- | --- | --- | --- | --- | --- |"]
        for (gamma, seq), r in sorted(cells.items()):
            rows.append(f"| {gamma} | {seq} | {_g(r.get('nvml_peak_used_bytes'))} | {_g(r['estimated_total_bytes'])} | "
                        f"{_pct(r.get('estimate_error'))} | {_pct(r.get('reserved_paged_error'))} |")
    return "\n".join(rows)


def _child(cfg: Config, args, tmp: str, remaining: float | None, partial: Path) -> dict:
    # A fresh process per run: the cap, the allocator's setting and peaks, bitsandbytes' page
    # manager all start clean, and one run's OOM cannot poison the next. Tiny runs on CPU have
    # none of these, and most of a child's time would be its imports: they run in this process.
    # Either writes its result so far into `partial` after every step: a run cut at its time
    # keeps what it measured.
    if args.tiny:
        try:
            return one_run(cfg, True, args.cap_gib, Path(tmp), partial)
        except Exception as e:
            return {"run": cfg.name, "steps_done": 0, "steps_planned": cfg.steps,
                    "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    cmd = [sys.executable, "-m", "benchmarks.gpu_8b_24gb", "--only", cfg.name, "--steps", str(cfg.steps),
           "--cap-gib", str(args.cap_gib), "--workdir", tmp, "--partial", str(partial)]
    env = {**os.environ, **cfg.env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    rc, stdout, stderr = gpu_box.run_boxed(cmd, remaining, cwd=REPO, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, env=env)
    if rc == 124:
        kept = json.loads(partial.read_text()) if partial.exists() else {"run": cfg.name, "steps_done": 0,
                                                                         "steps_planned": cfg.steps}
        return {**kept, "error": "timeout (budget)"}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not lines:
        tail = (stderr or stdout).strip().splitlines()[-1:] or ["no output"]
        return {"run": cfg.name, "steps_done": 0, "steps_planned": cfg.steps, "error": tail[0][:300]}
    return json.loads(lines[-1][len("RESULT "):])


def _write(args, results: list[dict], complete: bool) -> dict:
    summary = {"mode": "tiny-cpu" if args.tiny else "gpu", "cap_gib": args.cap_gib, "complete": complete,
               "budget_s": args.budget_s, "device": _device_name(args.tiny), "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    args.out.with_suffix(".md").write_text(tables(results) + "\n")
    return summary


def _device_name(tiny: bool) -> str | None:
    if tiny:
        return None
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _run_all(chosen: list[Config], args) -> list[dict]:
    """Each configuration in turn, skipped where the budget's time left is under its expected
    time. The clock is the GPU's: wall time on CUDA; with --tiny the expected GPU times of the runs
    so far, so a dry run skips exactly what the GPU run would."""
    spent, results = 0.0, []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for cfg, expected in zip(chosen, in_sequence([c.expected for c in chosen])):
            remaining = (None if args.budget_s is None else args.budget_s - spent) if args.tiny \
                else gpu_box.remaining(args.started, args.budget_s)
            spent += expected
            if remaining is not None and remaining < expected:
                results.append({"run": cfg.name, "steps_done": 0, "steps_planned": cfg.steps,
                                "skipped": f"budget ({remaining:.0f} s left, needs ~{expected:.0f} s)"})
            else:
                steps = args.steps or (cfg.tiny_steps if args.tiny else cfg.steps)
                partial = args.out.with_name(f"{args.out.stem}.{cfg.name}.partial.json")
                r = _child(Config(**{**cfg.__dict__, "steps": steps}), args, tmp, None if args.tiny else remaining,
                           partial)
                results.append({**r, "expected": cfg.expected})
                partial.unlink(missing_ok=True)
                keys = ("steps_done", "oom", "error", "estimate_error", "tokens_per_s")
                print(f"{cfg.name}: {json.dumps({k: results[-1].get(k) for k in keys})}", flush=True)
            _write(args, results, complete=False)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (tests)")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="per-process memory cap")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget: a configuration that would not finish in time is skipped")
    ap.add_argument("--started", type=float, default=time.time(),
                    help="time.time() the budget counts from (default: now; the plan's: when the step's box opened)")
    ap.add_argument("--configs", default=None, help="comma-separated subset, in the suite's order")
    ap.add_argument("--steps", type=int, default=None, help="steps per configuration (default: each its own)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_8b_24gb.json")
    ap.add_argument("--only", choices=sorted(BY_NAME), help=argparse.SUPPRESS)  # child process mode
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--partial", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.only:
        cfg = Config(**{**BY_NAME[args.only].__dict__, "steps": args.steps or BY_NAME[args.only].steps})
        print("RESULT " + json.dumps(one_run(cfg, args.tiny, args.cap_gib, args.workdir, args.partial)))
        return 0

    chosen = CONFIGS if not args.configs else [BY_NAME[n] for n in args.configs.split(",")]
    results = _run_all(chosen, args)
    _write(args, results, complete=True)
    print(tables(results))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
