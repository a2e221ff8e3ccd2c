"""The one adapter for other libraries' private or undocumented internals that lisaft needs.

Each entry says why no public form serves and which version it was checked against. Everything
else in lisaft uses public APIs; a library upgrade that breaks one of these breaks it here.
"""

from __future__ import annotations

import torch

# -- torch (checked against 2.13) -------------------------------------------------------------


# The step count as the fused kernel takes it, by (step, device): a CUDA tensor made from a
# Python number is a blocking host copy, one per chunk otherwise. The kernel only reads it.
_STEP_TENSORS: dict[tuple[int, torch.device], torch.Tensor] = {}


def step_tensor(step: int, dev: torch.device) -> torch.Tensor:
    key = (step, dev)
    t = _STEP_TENSORS.get(key)
    if t is None:  # CPU step threads may race here: at worst a count is made twice
        if len(_STEP_TENSORS) >= 16:  # the last few steps' counts
            _STEP_TENSORS.pop(next(iter(_STEP_TENSORS)), None)
        t = _STEP_TENSORS[key] = torch.tensor(float(step), device=dev)
    return t


def fused_adamw_(weights: list, grads: list, exp_avgs: list, exp_avg_sqs: list, steps: list, *, lr: float,
                 beta1: float, beta2: float, weight_decay: float, eps: float) -> None:
    """torch's fused AdamW kernel, the one torch.optim.AdamW(fused=True) runs. The public optimizer
    owns its own state; lisaft keeps per-unit moments (offloaded, sharded, stepped by chunks), so it
    calls the kernel on its own tensors."""
    torch._fused_adamw_(weights, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One multi-tensor kernel for many norms. torch.nn.utils.get_total_norm (2.6+) wraps it but
    the project supports torch 2.4 and needs the per-dtype grouping kept for the scaling below."""
    return list(torch._foreach_norm(tensors))


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """In-place scaling of many tensors in one kernel. clip_grads_with_norm_ (2.6+) scales a bf16
    gradient by a float32 factor; lisaft casts the factor to the gradient's dtype first, as its
    bf16 tests pin down."""
    torch._foreach_mul_(tensors, factor)


def sparse_sizes(g: torch.Tensor) -> tuple[int, int]:
    """(value elements, index elements) of a sparse COO tensor, coalesced or not. The public
    values()/indices() refuse an uncoalesced tensor, and coalescing only to count would copy it."""
    return g._values().numel(), g._indices().numel()


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """Names of the module's own buffers that stay out of its state_dict (rotary inv_freq). No
    public accessor lists them; they must be recomputed where weights come from a checkpoint."""
    return module._non_persistent_buffers_set


# -- bitsandbytes (checked against 0.50) --------------------------------------------------------


def mark_paged(t: torch.Tensor, device_index: int | None) -> torch.Tensor:
    """bitsandbytes recognises unified-memory tensors by these attributes (its optimizers set them
    on what F.get_paged returns); views do not inherit them."""
    # Attributes of bitsandbytes' own making, which torch.Tensor does not declare.
    t.is_paged = True  # type: ignore[attr-defined]
    t.page_deviceid = device_index  # type: ignore[attr-defined]
    return t


def page_device(t: torch.Tensor) -> int | None:
    """The device index `mark_paged` recorded on a unified-memory tensor."""
    return getattr(t, "page_deviceid", None)


def get_paged(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor in CUDA unified memory, as bitsandbytes' paged optimizers allocate their state."""
    import bitsandbytes.functional as F

    return F.get_paged(numel, dtype=dtype, device=device)


def prefetch_paged(t: torch.Tensor) -> None:
    """Start moving a unified-memory tensor to its GPU (cudaMemPrefetchAsync), as bitsandbytes'
    own optimizers do for each parameter's state before its update (Optimizer8bit.prefetch_state):
    without it, state evicted to the host comes back one page fault at a time."""
    import bitsandbytes.functional as F

    F.prefetch_tensor(t)


def fill_paged(t: torch.Tensor, value: float) -> None:
    """Fill a paged tensor where it lives: a torch fill_ would fault every page onto the GPU."""
    import bitsandbytes.functional as F

    F.fill(t, value)


def dynamic_maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The signed and unsigned dynamic code books of bitsandbytes' 8-bit Adam."""
    import bitsandbytes.functional as F

    return F.create_dynamic_map(signed=True).to(device), F.create_dynamic_map(signed=False).to(device)


def adam_update_8bit_blockwise(g, w, m, v, *, beta1: float, beta2: float, eps: float, step: int, lr: float,
                               code1, code2, absmax1, absmax2, weight_decay: float) -> None:
    """bitsandbytes' fused 8-bit blockwise Adam kernel on one chunk: its optimizer classes own
    their state and step whole tensors, lisaft steps chunks of per-unit state."""
    import bitsandbytes.functional as F

    F.optimizer_update_8bit_blockwise("adam", g, w, m, v, beta1, beta2, 0.0, 0.0, eps, step, lr, code1, code2,
                                      absmax1, absmax2, weight_decay=weight_decay)


def adam_update_32bit(g, w, m, v, *, beta1: float, beta2: float, eps: float, step: int, lr: float,
                      weight_decay: float) -> None:
    """bitsandbytes' fused 32-bit Adam kernel on one chunk (paged state; see above)."""
    import bitsandbytes.functional as F

    F.optimizer_update_32bit("adam", g, w, m, beta1, eps, step, lr, v, beta2, weight_decay=weight_decay)


# -- transformers (checked against 5.25 and, for input_require_grads_hooked, 4.57) ----------


def registered_mask_builder(kind: str):
    """The mask function transformers' AttentionMaskInterface holds for `kind` now."""
    from transformers.masking_utils import AttentionMaskInterface

    return AttentionMaskInterface._global_mapping[kind]


def input_require_grads_hooked(model: torch.nn.Module) -> bool:
    """Whether enable_input_require_grads left its hook on this PreTrainedModel. Its undo differs by
    version: 5.x keeps a list (`_require_grads_hooks`) on every PreTrainedModel and removes it safely;
    4.x (4.45 to 4.57, which pyproject still allows) keeps one `_require_grads_hook` on the model it
    was called on and raises AttributeError where there is none. No public query exists."""
    return bool(getattr(model, "_require_grads_hooks", None)) or hasattr(model, "_require_grads_hook")


def set_checkpointing_func(layer: torch.nn.Module, func) -> None:
    """A checkpointed transformers layer calls `layer._gradient_checkpointing_func(run, *inputs)`;
    a plain attribute, set past nn.Module's typed __setattr__."""
    object.__setattr__(layer, "_gradient_checkpointing_func", func)


# -- bitsandbytes (checked against 0.50) -------------------------------------------------------


def keep_4bit_layout_on_cpu(model: torch.nn.Module) -> None:
    """bitsandbytes' Linear4bit repacks its weight in place for an AVX512-BF16 CPU kernel on the first
    forward without grad in eval mode (lisaft's eval), and from then on holds the NF4 data in another
    layout, for some shapes not at all (out_features not a multiple of 32 fails). Training and merging
    then depend on whether an eval ran first; turning the fast path off keeps one layout, so a resumed
    QLoRA run is the same run. No public switch exists; the flag is set per module in __init__."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            object.__setattr__(module, "support_avx512bf16_for_cpu", False)  # a plain flag, not a tensor


def run_exit_handlers() -> None:
    """What the interpreter runs at exit before it tears down its objects, in its order: the
    threading module's own exit work (executors told to stop, every non-daemon thread joined),
    then the atexit functions."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
