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

from lisaft.memory.activations import (
    Shape,
    activations,
    loss_buffers_peak,
    mlp_chunked,
    offloaded_host_bytes,
    shape_from_config,
)
from lisaft.memory.counts import ParamCounts, param_counts
from lisaft.memory.cuda_process import (
    CUDA_CONTEXT_BYTES,
    CUDA_KERNELS_BYTES,
    allocator_overhead,
    cublas_workspace_bytes,
)
from lisaft.memory.host import offload_host_bytes
from lisaft.memory.lora import LoraSettings, layer_transient, lora_counts
from lisaft.memory.optimizer_state import StateBytes, state_bytes, step_temporaries
from lisaft.memory.sharded import clip_temporaries, fsdp_phases, fsdp_units
from lisaft.memory.trainable import sparse_embedding_saving, state_numels, trainable_numels

GiB = 1024**3
MiB = 1024**2

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Resident memory of the Python process itself on CPU: torch and transformers imported and a
# first forward/backward run (thread pools, oneDNN kernels), measured as the peak RSS of the
# tiny configuration of benchmarks/memory_accuracy.py (whose own tensors are ~3 MiB) on Linux
# x86-64, torch 2.13 CPU, transformers 5. Importing bitsandbytes adds 44 MiB, datasets 83 MiB.
CPU_PROCESS_BASELINE_BYTES = 356 * MiB
BITSANDBYTES_IMPORT_BYTES = 44 * MiB
DATASETS_IMPORT_BYTES = 83 * MiB

# training.fsdp only (lisaft/memory/sharded.py).
FSDP_COMPONENTS = ("gathered_units", "gradient_reduce", "unsharded_load")
COMPONENTS = (
    "weights", "gradients", "optimizer_states", "activations", "logits_loss", "transient", *FSDP_COMPONENTS,
    "cublas_workspace", "allocator_overhead", "cuda_context", "cuda_kernels", "process_baseline",
    "host_weight_copies",
)
# Outside PyTorch's allocator counters (torch.cuda.max_memory_reserved), inside NVML-used.
OUTSIDE_ALLOCATOR = ("cuda_context", "cuda_kernels")


@dataclass(frozen=True)
class Settings:
    """Everything the estimate depends on: the parsed recipe plus command-line flags."""

    model_label: str
    config: object  # transformers PretrainedConfig
    layers_path: str | None = None  # model.layers_path, where lisaft cannot find the layers itself
    dtype: str = "bfloat16"
    attention: str = "sdpa"  # flash_attention_2 | sdpa | eager
    gradient_checkpointing: bool = False
    offload_activations: bool = False  # checkpointed layer inputs kept in pinned host memory
    mlp_chunk_tokens: int | None = None  # MLP run in checkpointed chunks of this many positions
    optimizer: str = "adamw_32bit"
    bf16_update: str = "stochastic"  # stochastic | nearest (optimizer.bf16_update)
    sparse_embedding_grad: bool = True  # model.sparse_embedding_grad (single process)
    in_backward: bool = False
    cpu_offload: bool = False  # moments, gradient accumulators and the step in host memory
    lisa: bool = False
    active_layers: int = 2
    active_layers_auto: bool = False  # lisa.active_layers: auto (active_layers holds the choice)
    train_embeddings: bool = True
    train_head: bool = True
    state_policy: str = "discard"
    batch_size: int = 1
    seq_len: int = 1024
    packing: bool = False  # data.packing: rows of documents kept apart by a mask or varlen kernels
    padded_rows: bool = False  # rows padded to the longest in a batch (batch > 1, no packing)
    grad_accum_steps: int = 1
    clipping: bool = True
    device: str = "cuda"
    budget_bytes: int = 24 * GiB
    host_budget_bytes: int | None = None  # the machine's RAM, for cpu_offload's host memory
    datasets_imported: bool = False  # on CPU, the process baseline includes `datasets`
    expandable_segments: bool = True  # CUDA allocator setting (lisaft sets it unless the user did)
    fsdp: bool = False  # training.fsdp: per-rank figures for `ranks` processes (memory/sharded.py)
    # model.config: a random init, built whole on every rank and then sharded (training.fsdp);
    # weights from model.name_or_path are read shard by shard and never whole on a rank.
    model_from_config: bool = False
    ranks: int = 1
    lora: LoraSettings | None = None  # lora.enabled: adapters on a frozen base (memory/lora.py)

    def with_(self, **changes) -> Settings:
        return replace(self, **changes)


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
    notes: list[str] = field(default_factory=list)

    @property
    def budget_bytes(self) -> int:
        return self.settings.budget_bytes

    @property
    def host_bytes(self) -> int:
        return sum(self.host_components.values())

    @property
    def fits_host(self) -> bool:
        """cpu_offload's host memory fits the machine's RAM (True when nothing is offloaded or
        the RAM is not known)."""
        budget = self.settings.host_budget_bytes
        return not self.host_components or budget is None or self.host_bytes <= budget

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
            "host_budget_bytes": s.host_budget_bytes,
            "fits_host": self.fits_host,
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "settings": {
                "model": s.model_label, "dtype": s.dtype, "attention": s.attention,
                "gradient_checkpointing": s.gradient_checkpointing,
                "offload_activations": s.offload_activations,
                "mlp_chunk_tokens": s.mlp_chunk_tokens, "optimizer": s.optimizer,
                "bf16_update": s.bf16_update, "sparse_embedding_grad": s.sparse_embedding_grad,
                "expandable_segments": s.expandable_segments,
                "in_backward": s.in_backward, "cpu_offload": s.cpu_offload, "lisa": s.lisa,
                "active_layers": s.active_layers if s.lisa else None,
                "active_layers_auto": s.lisa and s.active_layers_auto,
                "train_embeddings": s.train_embeddings, "train_head": s.train_head,
                "state_policy": s.state_policy, "batch_size": s.batch_size, "seq_len": s.seq_len,
                "grad_accum_steps": s.grad_accum_steps, "clipping": s.clipping, "device": s.device,
                "fsdp": s.fsdp, "ranks": s.ranks, "model_from_config": s.model_from_config,
                "lora": asdict(s.lora) if s.lora is not None else None,
            },
            "notes": list(self.notes),
        }


def _weight_bytes(counts: ParamCounts, dt: int) -> int:
    return counts.total * dt + counts.buffer_bytes_fp32 + \
        (counts.buffer_numel * 4 - counts.buffer_bytes_fp32) * dt // 4


def compute(s: Settings, counts: ParamCounts | None = None, shape: Shape | None = None) -> Estimate:
    counts = counts or param_counts(s.config, s.layers_path)
    shape = shape or shape_from_config(s.config)
    dt = DTYPE_BYTES[s.dtype]
    notes: list[str] = []

    # Under FSDP a rank holds its slice of every tensor: weights, gradients and moments follow.
    local = counts.sharded(s.ranks) if s.fsdp else counts
    # LoRA: the adapters (and the ends, when asked) are what trains; the base only weighs.
    lc = lora_counts(counts, s.config, s.layers_path, s.lora, dt) if s.lora is not None else None
    if lc is not None:
        local = lc.trainable
    trainable, trainable_layers = trainable_numels(local, s)
    trainable_params = sum(trainable_numels(counts if lc is None else local, s)[0])
    weights = _weight_bytes(local, dt) if lc is None else lc.weight_bytes
    sparse_saving = sparse_embedding_saving(local, shape, s, dt)
    grads_full = sum(trainable) * dt - sparse_saving
    state = state_bytes(s.optimizer, state_numels(local, s, trainable), dt, s.device)
    largest = max(trainable) if trainable else 0
    # The optimizer on the CPU: on CUDA no moment and no accumulated gradient is on the device.
    offload = s.cpu_offload and s.device == "cuda"
    if offload:
        state = StateBytes(0, 0)

    head_weight_trains = (not s.lisa) or (s.train_embeddings if counts.tied else s.train_head)
    ends_train = s.lora.train_embeddings if s.lora is not None else None
    head_weight_trains = ends_train if ends_train is not None else head_weight_trains
    # On CPU the host is the device: offloading moves nothing out of the memory that counts.
    offload_act = s.offload_activations and s.gradient_checkpointing and s.device == "cuda"
    act = activations(
        shape, dt, s.batch_size, s.seq_len, s.attention, s.gradient_checkpointing,
        trainable_layers=trainable_layers,
        train_embeddings=(not s.lisa or s.train_embeddings) if ends_train is None else ends_train,
        head_weight_trains=head_weight_trains,
        final_norm_trains=(not s.lisa or s.train_head) if ends_train is None else ends_train,
        offload=offload_act, mlp_chunk_tokens=s.mlp_chunk_tokens, packing=s.packing,
        padded_rows=s.padded_rows and s.batch_size > 1,
    )
    saved_no_logp = act.layers + act.outside_layers + act.packed_mask
    loss_peak = loss_buffers_peak(shape, s.batch_size, s.seq_len, dt)
    if shape.final_softcap and act.log_probs:
        loss_peak += act.log_probs - s.batch_size * s.seq_len * (4 * shape.vocab + 8)
    tokens = s.batch_size * s.seq_len
    # Gradient of the hidden states flowing down, and of one layer's largest intermediates.
    # A chunked MLP's intermediate gradients are one chunk's, counted in act.mlp_chunk.
    chunked = mlp_chunked(s.seq_len, s.mlp_chunk_tokens)
    backward_temp = tokens * dt * 2 * (shape.hidden + (0 if chunked else shape.intermediate))
    head_grad = sum(local.head) * dt if (not s.lisa or s.train_head) else 0
    if counts.tied and head_weight_trains and not s.fsdp:  # FSDP: in the root's gradient_reduce
        head_grad += sum(counts.embeddings[:1]) * dt

    if s.in_backward:
        # Each gradient is applied and freed as soon as it is complete: at most the largest
        # tensor's gradient exists at a time, and there is no separate optimizer step.
        grads_at_loss = 0
        grads_in_layers = largest * dt
        step_phase = None
        notes.append("in_backward: no full gradient set is ever resident; clipping is off")
    elif offload:
        # Each gradient leaves for host memory as it is completed: the one being copied out and
        # the next one being produced; the step runs on the CPU.
        grads_at_loss, grads_in_layers, step_phase = 0, 2 * largest * dt, None
    else:
        grads_at_loss = grads_full if s.grad_accum_steps > 1 else 0
        grads_in_layers = max(grads_at_loss, head_grad)
        step_phase = grads_full
    recompute = (act.one_layer_full if s.gradient_checkpointing else 0) + act.mlp_chunk
    if lc is not None:  # A's outputs (and dropout's copies): every layer's, or the recomputed one's
        lora_saved = tokens * lc.saved_per_token_layer
        recompute += lora_saved if s.gradient_checkpointing else 0
        saved_no_logp += 0 if s.gradient_checkpointing else lora_saved * shape.layers
        backward_temp += layer_transient(lc, s.lora, dt)
    sparse_numel = counts.embeddings[0] if sparse_saving else 0
    step_temp = 0 if offload else step_temporaries(s.optimizer, largest, dt, s.device, s.bf16_update, sparse_numel)
    in_bwd_step = step_temp if s.in_backward else 0
    if s.fsdp:
        # The norm of the slices comes before the update: the larger of the two.
        step_temp = max(step_temp, clip_temporaries(largest, dt))
    elif s.clipping and not s.in_backward and not offload:
        step_temp += 8 * len(trainable)  # one float32 norm per tensor, and their stack

    extra = fsdp_phases(fsdp_units(counts, s), dt, s.ranks) if s.fsdp else {}

    def moment(grads: int, acts: int, loss: int, transient: int, name: str) -> dict[str, int]:
        """The components at one moment of the step; weights and (after the first step) the
        optimizer state are resident throughout."""
        m = {"weights": weights, "gradients": grads, "optimizer_states": state.total, "activations": acts,
             "logits_loss": loss, "transient": transient}
        if s.fsdp:
            m["gathered_units"], m["gradient_reduce"] = extra.get(name, (0, 0))
            m["unsharded_load"] = 0
        return m

    phases = {
        "loss_backward": moment(grads_at_loss, saved_no_logp, loss_peak, 0, "loss_backward"),
        "layer_backward": moment(grads_in_layers, saved_no_logp, 0, recompute + backward_temp + in_bwd_step,
                                 "layer_backward"),
    }
    if step_phase is not None:
        phases["optimizer_step"] = moment(step_phase, 0, 0, step_temp, "optimizer_step")
    if "root_backward" in extra:  # the embeddings' backward ends it: every other slice's gradient is kept
        phases["root_backward"] = moment(grads_full, 0, 0, 0, "root_backward")
    if s.fsdp and s.model_from_config:  # set-up: the whole model on the device before fully_shard splits it
        phases["model_load"] = {**moment(0, 0, 0, 0, "model_load"), "optimizer_states": 0,
                                "unsharded_load": _weight_bytes(counts, dt) - weights}

    cuda = s.device == "cuda"
    if cuda:
        outside = {"cuda_context": CUDA_CONTEXT_BYTES, "cuda_kernels": CUDA_KERNELS_BYTES}
    else:
        baseline = CPU_PROCESS_BASELINE_BYTES + (BITSANDBYTES_IMPORT_BYTES if s.optimizer != "adamw_32bit" else 0)
        outside = {"process_baseline": baseline + (DATASETS_IMPORT_BYTES if s.datasets_imported else 0)}
        if s.cpu_offload:
            # The host is the device: the step's weight copies are in the memory that counts.
            outside["host_weight_copies"] = counts.total * dt
    fixed = sum(outside.values())
    workspace = cublas_workspace_bytes() if cuda else 0

    def phase_bytes(m: dict[str, int], with_paged: bool) -> tuple[int, int]:
        # The caching allocator's reserve applies to what it hands out (the cuBLAS workspaces
        # among it); paged state is unified memory outside it, the context outside both.
        paged = state.paged if m["optimizer_states"] else 0
        allocated = sum(m.values()) - paged + workspace
        overhead = allocator_overhead(allocated, s.expandable_segments) if cuda else 0
        return allocated + overhead + (paged if with_paged else 0) + fixed, overhead

    def with_fixed(m: dict[str, int]) -> dict[str, int]:
        cuda_terms = {"cublas_workspace": workspace, "allocator_overhead": phase_bytes(m, True)[1]} if cuda else {}
        return {**m, **cuda_terms, **outside}

    totals = {name: phase_bytes(m, True)[0] for name, m in phases.items()}
    peak_phase = max(totals, key=totals.get)
    total = totals[peak_phase]
    components = with_fixed(phases[peak_phase])

    # With a paged optimizer the driver evicts paged state to host when the device is short, so
    # the device must hold at least everything else; what is left over keeps paged state.
    without_paged = max(phase_bytes(parts, False)[0] for parts in phases.values())
    paged_gpu = max(0, min(state.paged, s.budget_bytes - without_paged))
    paged_host = state.paged - paged_gpu
    if s.device != "cuda" and s.optimizer.startswith("paged_"):
        notes.append("paged optimizers run unpaged on CPU: their state is ordinary memory")
    if s.offload_activations and not s.gradient_checkpointing:
        notes.append("offload_activations needs gradient_checkpointing: nothing is offloaded")
    activation_host = offloaded_host_bytes(shape, dt, s.batch_size, s.seq_len) if offload_act else 0
    host = {}
    if offload:
        all_numels = list(counts.embeddings) + [n for layer in counts.layers for n in layer] + list(counts.head)
        sparse = counts.embeddings[0] if sparse_saving else 0
        # LISA's offload_cpu keeps frozen units' moments in host memory, beside the trained ones.
        host_state = state_numels(counts, s.with_(device="cpu"), trainable)
        host = offload_host_bytes(s.optimizer, host_state, all_numels, trainable, dt, s.bf16_update,
                                  activation_host, CPU_PROCESS_BASELINE_BYTES
                                  + (BITSANDBYTES_IMPORT_BYTES if s.optimizer != "adamw_32bit" else 0),
                                  sparse_numel=sparse, sparse_bytes=sparse * dt - sparse_saving if sparse else 0)
        notes.append("cpu_offload: moments, gradient accumulators and the step live in host memory "
                     "(the host table)")
    if act.packed_mask:
        # The same mask serves packed rows (documents kept apart) and padded rows (padding hidden).
        what = ("data.packing under {a}: each row's documents are kept apart by" if s.packing else
                "rows padded to the longest in the batch under {a}: the padding is hidden by")
        notes.append(f"{what.format(a=s.attention)} a {s.seq_len} x {s.seq_len} mask "
                     f"({act.packed_mask / 2**20:,.0f} MiB for the micro-batch); flash_attention_2 needs none")
    if s.fsdp:
        notes.append(f"training.fsdp over {s.ranks} ranks: one rank's memory (rank 0 holds the largest slices); NCCL's "
                     "buffers are not modelled" + ("; the peak is the set-up, where each rank holds the whole "
                                                   "model before sharding it" if peak_phase == "model_load" else ""))
    if s.lisa and s.state_policy == "keep":
        notes.append("lisa.state_policy keep: moments of every layer ever sampled stay resident "
                     "(counted as all layers)")
    return Estimate(
        settings=s, total_params=counts.total, trainable_params=trainable_params,
        components=components, phase_components={name: with_fixed(m) for name, m in phases.items()},
        sizes={"weights": weights, "gradients": grads_in_layers if offload else grads_full,
               "optimizer_states": state.total,
               "activations": saved_no_logp, "logits_loss": loss_peak,
               "transient": max(step_temp, recompute + backward_temp + in_bwd_step),
               **{k: max(m[k] for m in phases.values()) for k in FSDP_COMPONENTS if s.fsdp}},
        phases=totals, peak_phase=peak_phase, total_bytes=total,
        paged_state_bytes=state.paged, paged_gpu_bytes=paged_gpu, paged_host_bytes=paged_host,
        resident_without_paged_bytes=without_paged, saved_activation_bytes=act.saved,
        activation_host_bytes=activation_host, host_components=host, notes=notes,
    )
