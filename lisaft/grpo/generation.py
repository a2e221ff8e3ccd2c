"""Sampling GRPO's completions on the policy itself: transformers' generate with its KV cache on
the training weights (no second copy), prompts left-padded, the recipe's sampling settings.

The sampler's randomness is a pure function of the run's position: each group draws from its
own seed, a hash of (training.seed, the generation's index, the group's index over every rank), so
a group's completions are the same whichever rank, batch or world size samples it (two ranks equal
one process at twice the batch), a resumed run draws the same ones it drew before it stopped, and
nothing about sampling needs to be checkpointed. The draw is made in a logits processor from
uniforms fixed up front by the group's seed (generate's own draw then has one token to pick), so
the batch stays one generate call. The forward runs in eval mode (no dropout, no gradient
checkpointing, which would turn the cache off) and the mode is put back after.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch

from lisaft.config.grpo import GrpoSection


def sampling_seed(seed: int, generation: int, group: int) -> int:
    """The seed of one group of one generation (`group` counted over every rank); a hash, so
    neighbouring positions draw unrelated streams."""
    digest = hashlib.sha256(f"grpo-sampling:{seed}:{generation}:{group}".encode()).digest()
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
    """generate's settings, whole: a model's own generation_config.json (a repetition penalty, a
    default top_k) must not change what is sampled. Temperature, top_k and top_p are neutral here:
    _seeded_draw applies the recipe's."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                            max_new_tokens=grpo.max_completion_length, pad_token_id=pad_id, eos_token_id=eos_ids,
                            use_cache=True)


def _uniforms(seeds: list[int], rows: int, width: int) -> torch.Tensor:
    """[rows, width] uniforms, each group's rows (rows / len(seeds) of them) from its own seed, on
    the host so every device draws the same."""
    per_group = rows // len(seeds)
    return torch.cat([torch.rand(per_group, width, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                      for s in seeds])


def _seeded_draw(grpo: GrpoSection, uniforms: torch.Tensor, prompt_width: int):
    """A logits processor that warps as the recipe says (transformers' own warpers), draws each
    row's token by inverse CDF from its next uniform, and leaves only that token possible."""
    import transformers as tf

    warpers: list = []  # in generate's order, on generate's conditions
    if grpo.temperature != 1.0:
        warpers.append(tf.TemperatureLogitsWarper(grpo.temperature))
    if grpo.top_k > 0:
        warpers.append(tf.TopKLogitsWarper(grpo.top_k))
    if grpo.top_p < 1.0:
        warpers.append(tf.TopPLogitsWarper(grpo.top_p))

    class SeededDraw(tf.LogitsProcessor):
        def __call__(self, input_ids, scores):
            for warp in warpers:
                scores = warp(input_ids, scores)
            cdf = scores.double().softmax(-1).cumsum(-1)
            u = uniforms[:, input_ids.size(1) - prompt_width] * cdf[:, -1]
            token = torch.searchsorted(cdf, u[:, None], right=True).clamp_max(scores.size(-1) - 1)
            return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)

    return tf.LogitsProcessorList([SeededDraw()])


@contextlib.contextmanager
def _eval_mode(model):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def sample(model, prompts: list[list[int]], grpo: GrpoSection, pad_id: int, eos_ids: list[int],
           seeds: list[int]) -> Sampled:
    """One completion per entry of `prompts` (each group's prompt repeated G times), group k drawn
    from seeds[k]."""
    device = model.get_input_embeddings().weight.device
    ids, mask = left_padded(prompts, pad_id, device)
    draw = _seeded_draw(grpo, _uniforms(seeds, len(prompts), grpo.max_completion_length).to(device), ids.size(1))
    devices = [device] if device.type == "cuda" else []
    # generate's own multinomial still advances the global RNG: the fork leaves the run's as it was.
    with torch.random.fork_rng(devices=devices), _eval_mode(model), torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=_config(grpo, pad_id, eos_ids),
                             logits_processor=draw)
    return Sampled(ids, mask, out[:, ids.size(1):])
