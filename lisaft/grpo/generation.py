"""Sampling GRPO's completions on the policy itself: transformers' generate with its KV cache on
the training weights (no second copy), prompts left-padded, the recipe's sampling settings.

The sampler's randomness is a pure function of the run's position: each generation reseeds from
(training.seed, the generation's index, the rank) inside a forked RNG, so ranks draw different
answers, a resumed run draws the same ones it drew before it stopped, and nothing about sampling
needs to be checkpointed. The forward runs in eval mode (no dropout, no gradient checkpointing,
which would turn the cache off) and the mode is put back after.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

from lisaft.config.grpo import GrpoSection


def sampling_seed(seed: int, generation: int, rank: int) -> int:
    """The seed of one generation on one rank; a hash, so neighbouring positions draw unrelated
    streams."""
    digest = hashlib.sha256(f"grpo-sampling:{seed}:{generation}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one [rows, longest] tensor padded on the left, and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@dataclass(frozen=True)
class Sampled:
    prompt_ids: torch.Tensor       # [rows, P] left-padded
    prompt_mask: torch.Tensor      # [rows, P]
    completion_ids: torch.Tensor   # [rows, C] as generated (pad after EOS)


def _config(grpo: GrpoSection, pad_id: int, eos_ids: list[int]):
    """The sampling settings, whole: a model's own generation_config.json (a repetition penalty, a
    default top_k) must not change what the recipe says is sampled."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, temperature=grpo.temperature, top_p=grpo.top_p, top_k=grpo.top_k,
                            max_new_tokens=grpo.max_completion_length, pad_token_id=pad_id, eos_token_id=eos_ids,
                            use_cache=True)


@contextlib.contextmanager
def _eval_mode(model):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def sample(model, prompts: list[list[int]], grpo: GrpoSection, pad_id: int, eos_ids: list[int],
           seed: int) -> Sampled:
    """One completion per entry of `prompts` (each group's prompt repeated G times)."""
    device = model.get_input_embeddings().weight.device
    ids, mask = left_padded(prompts, pad_id, device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _eval_mode(model), torch.no_grad():
        torch.manual_seed(seed)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=_config(grpo, pad_id, eos_ids))
    return Sampled(ids, mask, out[:, ids.size(1):])
