"""The estimator's GRPO terms (a recipe with a `grpo` section): the moments of a step before its
training, where completions are sampled and scored. lisaft/memory/grpo.py says them.

A GRPO step has two peaks, one after the other (lisaft/train/objectives/grpo.py samples every
generation of a step before its first micro-batch trains):
- generation (lisaft/grpo/generation.py): transformers' generate with its KV cache on the
  policy's own weights, no second copy (cpu_offload: the device's bf16 weights). Weights and
  optimizer state are resident, no gradient exists, nothing is saved for backward. On top: the
  KV cache of every sequence of the generation batch (training.batch_size x steps_per_generation)
  at its full length, prompt + max_completion_length less the last token (sampled, never fed
  back); the sampling logits of the last position of
  each sequence; and the larger of the prefill (one layer's forward over every prompt token) and
  the last token (one layer's keys or values copied as the cache grows by concatenation).
- scoring: where the generation's log-probs are kept (it outlives its step: the old policy's) or
  a reference is scored (β > 0), one forward without gradients over the whole generation batch,
  prompt and completion (lisaft/grpo/rollout.py `_scored_logps`).
- training: the step's moments as for SFT, batch_size completions of up to data.max_seq_len
  tokens each, log-probs chunked over the vocabulary (lisaft/grpo/loss.py), plus with β > 0 and
  no adapters the reference: a frozen copy of the initial weights, resident at every moment.

The prompt is taken at its longest: data.max_seq_len - max_completion_length tokens, the most
`lisaft train` accepts (lisaft/train/objectives/grpo.py `before_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lisaft.memory.activations import FP32, INT64, Shape, attention_scores_bytes, loss_chunk_tokens

if TYPE_CHECKING:
    from lisaft.memory.settings import Settings
    from lisaft.memory.step_terms import Resident

# Per logit of each sampled sequence's last position, at every new token (transformers 5's
# sampling loop): the head's output in the model dtype, its float32 copy and the float32
# probabilities multinomial draws from.
SAMPLING_FP32_COPIES = 2
# ... and what the filters add: temperature != 1 divides into a new float32 tensor; top_k a
# masked copy; top_p sorts (float32 values, int64 indices), softmaxes and sums them, builds two
# boolean masks and a masked copy.
TEMPERATURE_BYTES = FP32
TOP_K_BYTES = FP32 + 1
TOP_P_BYTES = FP32 + INT64 + FP32 + FP32 + 1 + 1 + FP32


@dataclass(frozen=True)
class GenerationTerms:
    """A GRPO step's sampling and scoring, in bytes, with the sizes they come from."""

    sequences: int          # completions sampled at once on a rank: batch_size x steps_per_generation
    prompt_tokens: int      # the longest prompt: data.max_seq_len - max_completion_length
    completion_tokens: int  # max_completion_length
    kv_per_token: int       # layers x 2 (K, V) x kv_heads x head_dim x dtype bytes
    sampling_per_logit: int
    vocab: int
    prefill: int            # one layer's forward over every prompt token of the batch
    last_token: int         # one token's forward and one layer's keys or values copied
    scoring: int | None     # the forward that scores the whole batch (None: not run)
    scoring_loss: int       # its log-probs, chunked over the vocabulary
    scoring_why: str        # whose log-probs the scoring pass computes
    reference_weights: int  # β > 0 without adapters: a frozen copy of the weights

    @property
    def full_length(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def kv_cache(self) -> int:
        """The KV cache at the last token: every sequence at its full length but the last token,
        which is sampled and never fed back (transformers' DynamicCache, checked in
        tests/unit/test_memory_grpo.py)."""
        return self.sequences * (self.full_length - 1) * self.kv_per_token

    @property
    def prefill_cache(self) -> int:
        return self.sequences * self.prompt_tokens * self.kv_per_token

    @property
    def sampling_logits(self) -> int:
        return self.sequences * self.vocab * self.sampling_per_logit

    @property
    def prefill_peak(self) -> bool:
        """Whether the prefill, not the last token, is the generation's larger moment."""
        return self.prefill_cache + self.prefill > self.kv_cache + self.last_token


def kv_bytes_per_token(shape: Shape, dt: int) -> int:
    """The KV cache of one token of one sequence: each layer keeps its keys and values."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * dt


def forward_bytes_per_token(shape: Shape, dt: int, seq_len: int, attention: str) -> int:
    """A decoder layer's forward without gradients, per token at its largest moment: the residual
    stream and the normed input beside the larger of the attention's tensors (q, k, v and the
    output; eager's scores; SDPA's k and v repeated to every head under a padding mask) and the
    MLP's three intermediates (gate's activation, up, their product)."""
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    attn = dt * (2 * q + 2 * kv) + (attention_scores_bytes(shape, dt, seq_len, attention)
                                    if attention == "eager" else 0)
    if attention == "sdpa":
        attn += 2 * dt * (q - kv)
    return 2 * dt * h + max(attn, 3 * dt * shape.intermediate, FP32 * h)


def sampling_bytes_per_logit(s: Settings, dt: int) -> int:
    g = s.recipe.grpo
    assert g is not None, "asked of GRPO recipes only"
    return (dt + SAMPLING_FP32_COPIES * FP32 + (TEMPERATURE_BYTES if g.temperature != 1.0 else 0)
            + (TOP_K_BYTES if g.top_k else 0) + (TOP_P_BYTES if g.top_p < 1.0 else 0))


def steps_per_generation(s: Settings) -> int:
    """grpo.steps_per_generation resolved. Not config/grpo.py's generation_shape, which refuses a batch
    that is not whole groups: the estimator's own variations (the largest batch) may try one."""
    g = s.recipe.grpo
    assert g is not None, "asked of GRPO recipes only"
    return g.steps_per_generation or s.recipe.training.grad_accum_steps


def scoring_why(s: Settings) -> str:
    """Whose log-probs a generation is scored with before training, '' for none."""
    g, t = s.recipe.grpo, s.recipe.training
    assert g is not None, "asked of GRPO recipes only"
    outlives = t.grad_accum_steps % (steps_per_generation(s) * g.num_iterations) != 0
    who = ["the old policy's log-probs, the generation outliving its step"] if outlives else []
    if g.beta > 0:
        who.append("the reference's, for β > 0" + (", the base with the adapters off" if s.lora else ""))
    return " and ".join(who)


def generation_terms(s: Settings, shape: Shape, dt: int, r: Resident) -> GenerationTerms:
    g, t = s.recipe.grpo, s.recipe.training
    assert g is not None, "asked of GRPO recipes only"
    rows = t.batch_size * steps_per_generation(s)
    prompt = max(0, s.recipe.data.max_seq_len - g.max_completion_length)
    full = prompt + g.max_completion_length
    adapter = r.lora.transient if r.lora is not None else 0
    why = scoring_why(s)
    scoring, scoring_loss = None, 0
    if why:
        tokens = rows * full
        chunk = loss_chunk_tokens(shape, tokens) or tokens
        # The last hidden state of every position, the log-probs returned, one layer's forward.
        scoring = tokens * (dt * shape.hidden + FP32 + forward_bytes_per_token(shape, dt, full, s.attention)) + adapter
        scoring_loss = chunk * shape.vocab * (FP32 + dt)
    return GenerationTerms(
        sequences=rows, prompt_tokens=prompt, completion_tokens=g.max_completion_length,
        kv_per_token=kv_bytes_per_token(shape, dt), sampling_per_logit=sampling_bytes_per_logit(s, dt),
        vocab=shape.vocab, prefill=rows * prompt * forward_bytes_per_token(shape, dt, prompt, s.attention) + adapter,
        last_token=rows * forward_bytes_per_token(shape, dt, full, s.attention) + rows * full * shape.kv_dim * dt
        + adapter,
        scoring=scoring, scoring_loss=scoring_loss, scoring_why=why,
        reference_weights=r.weights if g.beta > 0 and r.lora is None else 0)


Moment = Callable[[int, int, int, int, str], dict[str, int]]


def generation_phases(terms: GenerationTerms, moment: Moment) -> dict[str, dict[str, int]]:
    """The generation's moment (the larger of the prefill and the last token) and the scoring
    pass's, each from `moment(grads, activations, loss, transient, name)` with the GRPO
    components set: no gradient and nothing saved at either."""
    if terms.prefill_peak:
        cache, transient = terms.prefill_cache, terms.prefill
    else:
        cache, transient = terms.kv_cache, terms.last_token
    phases = {"generation": {**moment(0, 0, 0, transient, "generation"), "kv_cache": cache,
                             "sampling_logits": terms.sampling_logits}}
    if terms.scoring is not None:
        phases["scoring_pass"] = moment(0, 0, terms.scoring_loss, terms.scoring, "scoring_pass")
    return phases


def grpo_components(terms: GenerationTerms) -> dict[str, int]:
    """What a GRPO recipe adds to every moment: the generation's two, 0 outside it, and the
    reference's weights where they exist."""
    out = {"kv_cache": 0, "sampling_logits": 0}
    if terms.reference_weights:
        out["reference_weights"] = terms.reference_weights
    return out
