"""The estimator's compute step: settings in, every component's bytes and the peak out.

A training step's memory peaks at one of three moments, and the estimate is the largest:
- loss backward: all activations are saved and the vocab x tokens loss buffers are at their
  largest (gradients of earlier micro-batches are resident when accumulating);
- layer backward: the head's gradient exists, and with checkpointing one layer is recomputed;
- optimizer step: every gradient of the trainable set exists, plus the step's temporaries.
Weights and optimizer state are resident throughout (state is kept between steps).
docs/memory.md gives every formula.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from lisaft.config.compat import offload_accumulation
from lisaft.config.optimizers import optimizer_kind
from lisaft.memory.activations import Shape, offloaded_host_bytes, shape_from_config
from lisaft.memory.counts import ParamCounts, param_counts
from lisaft.memory.cuda_process import (
    CUDA_CONTEXT_BYTES,
    CUDA_KERNELS_BYTES,
    allocator_overhead,
    cublas_workspace_bytes,
)
from lisaft.memory.generation import GenerationTerms, generation_phases, generation_terms, grpo_components
from lisaft.memory.host import offload_host_bytes
from lisaft.memory.layer_major import HOST_RAM_SHARE, LayerMajorTerms, device_phases, layer_major_terms
from lisaft.memory.settings import DTYPE_BYTES, GiB, Settings, moment_bytes
from lisaft.memory.sharded import fsdp_phases, fsdp_units
from lisaft.memory.step_terms import Backward, Resident, backward, resident, weight_bytes

__all__ = ["DTYPE_BYTES", "GiB", "MiB", "Estimate", "Settings", "compute"]
from lisaft.memory.trainable import state_numels

MiB = 1024**2

# Resident memory of the Python process itself on CPU: torch and transformers imported and a
# first forward/backward run (thread pools, oneDNN kernels), measured as the peak RSS of the
# tiny configuration of benchmarks/memory_accuracy.py (whose own tensors are ~3 MiB) on Linux
# x86-64, torch 2.13 CPU, transformers 5. Importing bitsandbytes adds 44 MiB, datasets 83 MiB;
# peft (a LoRA run) imports bitsandbytes and adds 9 MiB of its own (peft 0.21): the RSS before and
# after `from peft import LoraConfig, get_peft_model` in an interpreter that imported torch and
# transformers, 54 MiB in all.
CPU_PROCESS_BASELINE_BYTES = 356 * MiB
BITSANDBYTES_IMPORT_BYTES = 44 * MiB
DATASETS_IMPORT_BYTES = 83 * MiB
PEFT_IMPORT_BYTES = 9 * MiB

# training.fsdp only (lisaft/memory/sharded.py).
FSDP_COMPONENTS = ("gathered_units", "gradient_reduce", "unsharded_load")
# A grpo section only (lisaft/memory/generation.py).
GRPO_COMPONENTS = ("kv_cache", "sampling_logits", "reference_weights")
# Moments before the first step: a random init whole on each rank (training.fsdp), the reference pass.
SETUP_PHASES = ("model_load", "reference_pass")
# Outside PyTorch's allocator counters (torch.cuda.max_memory_reserved), inside NVML-used.
OUTSIDE_ALLOCATOR = ("cuda_context", "cuda_kernels")


@dataclass
class Estimate:
    settings: Settings
    total_params: int
    trainable_params: int
    components: dict[str, int]  # bytes at the peak moment; they sum to total_bytes
    phase_components: dict[str, dict[str, int]]  # the same at each moment; each sums to its phases[] total
    sizes: dict[str, int]  # each component's full size, whenever it peaks
    phases: dict[str, int]
    peak_phase: str
    total_bytes: int
    paged_state_bytes: int
    paged_gpu_bytes: int
    paged_host_bytes: int
    resident_without_paged_bytes: int  # the peak when every paged byte is evicted to host
    saved_activation_bytes: int  # what saved-tensor hooks measure at the end of forward
    activation_host_bytes: int = 0  # pinned host memory of offloaded layer inputs
    host_components: dict[str, int] = field(default_factory=dict)  # cpu_offload on CUDA (memory/host.py)
    layer_major: LayerMajorTerms | None = None  # optimizer.offload_accumulation device (memory/layer_major.py)
    generation: GenerationTerms | None = None  # a grpo section (memory/generation.py)
    notes: list[str] = field(default_factory=list)

    @property
    def budget_bytes(self) -> int:
        return self.settings.budget_bytes

    @property
    def host_bytes(self) -> int:
        """What the run keeps in host memory: cpu_offload's host components, else the pinned layer
        inputs of model.offload_activations (0 when neither runs)."""
        return sum(self.host_components.values()) if self.host_components else self.activation_host_bytes

    @property
    def fits_host(self) -> bool:
        """That host memory fits the machine's RAM (the host budget; True when the RAM is not known)."""
        budget = self.settings.host_budget_bytes
        return budget is None or self.host_bytes <= budget

    @property
    def fits(self) -> bool:
        """Fits with everything resident on the device (nothing paged to host), and the host
        memory of cpu_offload fits the machine's RAM."""
        return self.total_bytes <= self.budget_bytes and self.fits_host

    @property
    def fits_with_paging(self) -> bool:
        return self.resident_without_paged_bytes <= self.budget_bytes

    @property
    def comparable_peak_bytes(self) -> int:
        """The peak as a process can measure it: on CUDA torch.cuda.max_memory_reserved plus
        paged optimizer state (the CUDA context and kernel images are outside both); on CPU
        the peak RSS. On CUDA `total_bytes` is the NVML-used figure."""
        return self.total_bytes - sum(self.components.get(k, 0) for k in OUTSIDE_ALLOCATOR)

    @property
    def weights_bytes(self) -> int:
        return self.sizes["weights"]

    @property
    def grad_bytes(self) -> int:
        return self.sizes["gradients"]

    @property
    def optimizer_state_bytes(self) -> int:
        return self.sizes["optimizer_states"]

    def to_json(self) -> dict:
        s = self.settings
        return {
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "fits_with_paging": self.fits_with_paging,
            "components": dict(self.components),
            "sizes": dict(self.sizes),
            "peak_phase": self.peak_phase,
            "phases": dict(self.phases),
            "phase_components": {k: dict(v) for k, v in self.phase_components.items()},
            "paged_state_bytes": self.paged_state_bytes,
            "paged_gpu_bytes": self.paged_gpu_bytes,
            "paged_host_bytes": self.paged_host_bytes,
            "saved_activation_bytes": self.saved_activation_bytes,
            "activation_host_bytes": self.activation_host_bytes,
            "host_bytes": self.host_bytes,
            "host_components": dict(self.host_components),
            "layer_major": asdict(self.layer_major) if self.layer_major is not None else None,
            "host_budget_bytes": s.host_budget_bytes,
            "fits_host": self.fits_host,
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "settings": s.to_json(),
            "notes": list(self.notes),
        }


def compute(s: Settings, counts: ParamCounts | None = None, shape: Shape | None = None) -> Estimate:
    rec = s.recipe
    counts = counts or param_counts(s.config, rec.model.layers_path)
    shape = shape or shape_from_config(s.config)
    dt = DTYPE_BYTES[rec.model.dtype]
    r = resident(s, counts, shape, dt)
    b = backward(s, counts, shape, dt, r)
    gen = generation_terms(s, shape, dt, r) if s.recipe.grpo is not None else None
    phases = _phases(s, counts, dt, r, b, gen)
    fixed = _Fixed.of(s, counts, r.state.paged)
    tokens = (s.sequences, rec.data.max_seq_len)
    activation_host = offloaded_host_bytes(shape, dt, *tokens) if b.offload_act else 0
    lm = _layer_major(s, counts, shape, dt, r, b, phases, fixed, activation_host)
    if lm is not None:
        phases = device_phases(phases, s, counts, dt, r, b, lm)
    totals = {name: fixed.total(m, True)[0] for name, m in phases.items()}
    peak_phase = max(totals, key=lambda name: totals[name])
    # With a paged optimizer the driver evicts paged state to host when the device is short, so
    # the device must hold at least everything else; what is left over keeps paged state.
    without_paged = max(fixed.total(parts, False)[0] for parts in phases.values())
    paged_gpu = max(0, min(r.state.paged, s.budget_bytes - without_paged))
    return Estimate(
        settings=s, total_params=counts.total, trainable_params=r.trainable_params,
        components=fixed.with_fixed(phases[peak_phase]),
        phase_components={name: fixed.with_fixed(m) for name, m in phases.items()},
        sizes={"weights": r.weights, "gradients": b.grads_in_layers if r.offload else r.grads_full,
               "optimizer_states": r.state.total,
               "activations": b.saved_no_logp, "logits_loss": b.loss_peak,
               "transient": max(b.step_temp, b.layer_transient),
               **{k: max(m[k] for m in phases.values()) for k in FSDP_COMPONENTS if s.fsdp},
               **{k: max(m[k] for m in phases.values()) for k in GRPO_COMPONENTS if k in phases["layer_backward"]}},
        phases=totals, peak_phase=peak_phase, total_bytes=totals[peak_phase],
        paged_state_bytes=r.state.paged, paged_gpu_bytes=paged_gpu, paged_host_bytes=r.state.paged - paged_gpu,
        resident_without_paged_bytes=without_paged, saved_activation_bytes=b.act.saved,
        activation_host_bytes=activation_host, host_components=_host(s, counts, dt, r, activation_host, lm),
        layer_major=lm, generation=gen, notes=_notes(s, r, b, peak_phase),
    )


def _phases(s: Settings, counts: ParamCounts, dt: int, r: Resident, b: Backward,
            gen: GenerationTerms | None) -> dict[str, dict[str, int]]:
    """The components at each moment of the step that may be its peak."""
    extra = fsdp_phases(fsdp_units(counts, s), dt, s.ranks) if s.fsdp else {}

    def moment(grads: int, acts: int, loss: int, transient: int, name: str) -> dict[str, int]:
        """The components at one moment of the step; weights and (after the first step) the
        optimizer state are resident throughout."""
        m = {"weights": r.weights, "gradients": grads, "optimizer_states": r.state.total, "activations": acts,
             "logits_loss": loss, "transient": transient}
        if s.fsdp:
            m["gathered_units"], m["gradient_reduce"] = extra.get(name, (0, 0))
            m["unsharded_load"] = 0
        if gen is not None:
            m.update(grpo_components(gen))
        return m

    phases = {
        # The head's weight gradient is formed in the loss's backward (a chunked summed loss: in
        # its forward, kept to its backward), beside the loss buffers and every saved activation:
        # one head-sized buffer (lisaft/model/loss.py adds each chunk's part into it in place), on
        # top of the gradients resident from earlier micro-batches.
        "loss_backward": moment(b.grads_at_loss + b.head_grad, b.saved_no_logp, b.loss_peak, 0, "loss_backward"),
        "layer_backward": moment(b.grads_in_layers, b.saved_no_logp, 0, b.layer_transient, "layer_backward"),
    }
    if b.step_phase is not None:
        phases["optimizer_step"] = moment(b.step_phase, 0, 0, b.step_temp, "optimizer_step")
    if "root_backward" in extra:  # the embeddings' backward ends it: every other slice's gradient is kept
        phases["root_backward"] = moment(r.grads_full, 0, 0, 0, "root_backward")
    if s.reference_pass:
        phases["reference_pass"] = _reference_pass(moment(0, 0, b.loss_peak, 0, "loss_backward"), s, counts, r,
                                                   b, dt)
    if s.kl_pass:
        # KTO's KL sequences of a micro-batch, forward only, before the step's first micro-batch: no
        # gradient yet, nothing saved; the optimizer state resident.
        phases["kl_pass"] = moment(0, 0, b.loss_peak, b.act.one_layer_full + b.act.mlp_chunk, "loss_backward")
    if gen is not None:
        phases.update(generation_phases(gen, moment))
    if s.fsdp and s.recipe.model.config is not None:
        # Set-up: a random init is whole on the device before fully_shard splits it.
        phases["model_load"] = {**moment(0, 0, 0, 0, "model_load"), "optimizer_states": 0,
                                "unsharded_load": weight_bytes(counts, dt) - r.weights}
    return phases


def _reference_pass(m: dict[str, int], s: Settings, counts: ParamCounts, r: Resident, b: Backward,
                    dt: int) -> dict[str, int]:
    """The reference log-probs, one pass over the examples before step 1 (lisaft/train/preference.py):
    under no_grad nothing is saved for backward and no gradient exists; the optimizer is built
    after it, so no state; a layer's forward at a time (at most what its recompute holds, the
    dequantized weight of a 4-bit linear included) and the loss's chunk of log-probs, for the
    pass's sequences (a pair's two; KTO's answer and KL sequence, twice a training micro-batch's).
    Under FSDP the units gathered as in the forward, nothing reduced. The weights are the policy's,
    or a preference.reference of the same architecture, loaded as the policy's base (4-bit under
    QLoRA: train/preference.py reference_section) for the pass and freed before it."""
    if s.reference_sequences != s.sequences:  # the pass's batch of sequences, as a step's would be
        rec = s.recipe
        more = replace(s, recipe=rec.model_copy(update={"training": rec.training.model_copy(
            update={"batch_size": rec.training.batch_size * s.reference_sequences // s.sequences})}))
        b = backward(more, counts, shape_from_config(s.config), dt, r)
        m = {**m, "logits_loss": b.loss_peak}
    forward = b.act.one_layer_full + b.act.mlp_chunk + (r.lora.transient if r.lora is not None else 0)
    out = {**m, "optimizer_states": 0, "transient": forward}
    if "gradient_reduce" in out:
        out["gradient_reduce"] = 0
    return out


@dataclass(frozen=True)
class _Fixed:
    """What every moment adds to its components: memory outside PyTorch's allocator, the cuBLAS
    workspaces and the caching allocator's reserve."""

    outside: dict[str, int]
    workspace: int
    paged: int  # optimizer state in unified memory: outside the allocator
    cuda: bool
    expandable_segments: bool

    @classmethod
    def of(cls, s: Settings, counts: ParamCounts, paged: int) -> _Fixed:
        cuda = s.device == "cuda"
        if cuda:
            outside = {"cuda_context": CUDA_CONTEXT_BYTES, "cuda_kernels": CUDA_KERNELS_BYTES}
        else:
            bnb = optimizer_kind(s.recipe.optimizer.name).imports_bitsandbytes or s.lora
            baseline = CPU_PROCESS_BASELINE_BYTES + (BITSANDBYTES_IMPORT_BYTES if bnb else 0) + \
                (PEFT_IMPORT_BYTES if s.lora else 0)
            outside = {"process_baseline": baseline + (DATASETS_IMPORT_BYTES if s.datasets_imported else 0)}
            if s.recipe.optimizer.cpu_offload:
                # The host is the device: the step's weight copies are in the memory that counts.
                outside["host_weight_copies"] = counts.total * DTYPE_BYTES[s.recipe.model.dtype]
        return cls(outside, cublas_workspace_bytes() if cuda else 0, paged, cuda, s.expandable_segments)

    def total(self, m: dict[str, int], with_paged: bool) -> tuple[int, int]:
        """The moment's total, and the allocator's reserve within it."""
        # The caching allocator's reserve applies to what it hands out (the cuBLAS workspaces
        # among it); paged state is unified memory outside it, the context outside both.
        paged = self.paged if m["optimizer_states"] else 0
        allocated = sum(m.values()) - paged + self.workspace
        overhead = allocator_overhead(allocated, self.expandable_segments) if self.cuda else 0
        return allocated + overhead + (paged if with_paged else 0) + sum(self.outside.values()), overhead

    def with_fixed(self, m: dict[str, int]) -> dict[str, int]:
        cuda_terms = {"cublas_workspace": self.workspace, "allocator_overhead": self.total(m, True)[1]} \
            if self.cuda else {}
        return {**m, **cuda_terms, **self.outside}


def _layer_major(s: Settings, counts: ParamCounts, shape: Shape, dt: int, r: Resident, b: Backward,
                 phases: dict[str, dict[str, int]], fixed: _Fixed, activation_host: int) -> LayerMajorTerms | None:
    """The layer-major backward's terms, its group the most micro-batches whose saved inputs fit
    HOST_RAM_SHARE of the RAM beside everything else the run keeps there (on a CPU device: the
    whole run)."""
    if offload_accumulation(s.recipe) != "device":
        return None
    one = layer_major_terms(s, shape, dt, free_host_bytes=0)
    if s.device == "cuda":
        budget, held = s.host_budget_bytes, sum(_host(s, counts, dt, r, activation_host, None).values())
    else:
        budget = s.budget_bytes
        held = max(fixed.total(m, True)[0] for m in device_phases(phases, s, counts, dt, r, b, one).values())
        held -= one.host_bytes
    return layer_major_terms(s, shape, dt, None if budget is None else int(HOST_RAM_SHARE * budget) - held)


def _host(s: Settings, counts: ParamCounts, dt: int, r: Resident, activation_host: int,
          lm: LayerMajorTerms | None) -> dict[str, int]:
    """optimizer.cpu_offload on CUDA: the host memory of moments, accumulators and copies."""
    if not r.offload:
        return {}
    all_numels = list(counts.embeddings) + [n for layer in counts.layers for n in layer] + list(counts.head)
    sparse = counts.embeddings[0] if r.sparse_saving else 0
    # LISA's offload_cpu keeps frozen units' moments in host memory, beside the trained ones.
    host_state = state_numels(counts, s.with_(device="cpu"), r.trainable)
    opt = s.recipe.optimizer
    return offload_host_bytes(opt.name, host_state, all_numels, r.trainable, dt, opt.bf16_update,
                              activation_host, CPU_PROCESS_BASELINE_BYTES
                              + (BITSANDBYTES_IMPORT_BYTES if optimizer_kind(opt.name).imports_bitsandbytes else 0),
                              sparse_numel=sparse, sparse_bytes=sparse * dt - r.sparse_saving if sparse else 0,
                              moment_bytes=moment_bytes(opt.moments_dtype),
                              layer_inputs=lm.host_bytes if lm is not None else 0)


def _notes(s: Settings, r: Resident, b: Backward, peak_phase: str) -> list[str]:
    notes = []
    rec = s.recipe
    if rec.optimizer.in_backward:
        notes.append("in_backward: no full gradient set is ever resident; clipping is off")
    if s.device != "cuda" and optimizer_kind(rec.optimizer.name).paged:
        notes.append("paged optimizers run unpaged on CPU: their state is ordinary memory")
    if rec.model.offload_activations and not rec.model.gradient_checkpointing:
        notes.append("offload_activations needs gradient_checkpointing: nothing is offloaded")
    if r.offload:
        notes.append("cpu_offload: moments, gradient accumulators and the step live in host memory "
                     "(the host table)")
    if b.act.packed_mask:
        # The same mask serves packed rows (documents kept apart) and padded rows (padding hidden).
        what = ("data.packing under {a}: each row's documents are kept apart by" if rec.data.packing else
                "rows padded to the longest in the batch under {a}: the padding is hidden by")
        notes.append(f"{what.format(a=s.attention)} a {rec.data.max_seq_len} x {rec.data.max_seq_len} mask "
                     f"({b.act.packed_mask / 2**20:,.0f} MiB for the micro-batch); flash_attention_2 needs none")
    if s.fsdp:
        notes.append(f"training.fsdp over {s.ranks} ranks: one rank's memory (rank 0 holds the largest slices); NCCL's "
                     "buffers are not modelled" + ("; the peak is the set-up, where each rank holds the whole "
                                                   "model before sharding it" if peak_phase == "model_load" else ""))
    if rec.lisa.enabled and rec.lisa.state_policy == "keep":
        notes.append("lisa.state_policy keep: moments of every layer ever sampled stay resident "
                     "(counted as all layers)")
    return notes
