"""The estimator's GRPO terms said for people and scripts: the generation's peak beside the
training's, which is higher, and (--explain) the arithmetic of the KV cache, the sampling logits,
the prefill and the scoring pass. lisaft/memory/generation.py computes them.
"""

from __future__ import annotations

from lisaft.memory.activations import shape_from_config
from lisaft.memory.estimate import SETUP_PHASES, Estimate
from lisaft.memory.settings import DTYPE_BYTES
from lisaft.memory.tables import human

# The moments of a GRPO step before its training (memory/generation.py).
GENERATION_PHASES = ("generation", "scoring_pass")


def training_peak_phase(est: Estimate) -> str:
    """The training's own peak moment: neither the generation's nor the set-up's."""
    return max((p for p in est.phases if p not in GENERATION_PHASES + SETUP_PHASES), key=lambda p: est.phases[p])


def generation_peak_phase(est: Estimate) -> str:
    return max((p for p in est.phases if p in GENERATION_PHASES), key=lambda p: est.phases[p])


def grpo_summary(est: Estimate) -> dict | None:
    """The GRPO terms of `est` (None without a grpo section): what --json's `grpo` holds."""
    g = est.generation
    if g is None:
        return None
    gen, train = generation_peak_phase(est), training_peak_phase(est)
    return {
        "generation_peak_bytes": est.phases[gen], "generation_peak_phase": gen,
        "training_peak_bytes": est.phases[train], "training_peak_phase": train,
        "higher": "generation" if est.phases[gen] > est.phases[train] else "training",
        "generation_sequences": g.sequences, "prompt_tokens": g.prompt_tokens,
        "completion_tokens": g.completion_tokens,
        "kv_cache_bytes": g.kv_cache, "kv_cache_bytes_per_token": g.kv_per_token,
        "sampling_logits_bytes": g.sampling_logits, "prefill_bytes": g.prefill, "last_token_bytes": g.last_token,
        "generation_moment": "prefill" if g.prefill_peak else "last_token",
        "scoring_pass_bytes": est.phases.get("scoring_pass"),  # null: no scoring pass
        "reference_weights_bytes": g.reference_weights,
    }


def grpo_lines(est: Estimate, explain: bool = False) -> list[str]:
    """Both peaks and which is higher; with `explain`, the arithmetic of each generation term."""
    p = grpo_summary(est)
    if p is None:
        return []
    g = est.generation
    assert g is not None  # grpo_summary returned for it
    s = est.settings
    gen, train = p["generation_peak_bytes"], p["training_peak_bytes"]
    gen_phase, train_phase = (p[k].replace("_", " ") for k in ("generation_peak_phase", "training_peak_phase"))
    out = [f"GRPO: two peaks, one after the other. Generation {human(gen)} ({gen_phase}: {g.sequences} sequences "
           f"of {g.prompt_tokens} + {g.completion_tokens} tokens sampled at once on the "
           f"policy's weights, KV cache {human(g.kv_cache)}); training {human(train)} "
           f"({train_phase}: {s.recipe.training.batch_size} completions a micro-batch)"
           + (f"; between them the scoring pass, {human(p['scoring_pass_bytes'])}" if g.scoring is not None else "")
           + f". The {p['higher']} is higher; the fit verdict uses it."]
    if g.reference_weights:
        out.append(f"Reference (β {s.recipe.grpo.beta:g} without adapters): a frozen copy of the initial weights, "  # type: ignore[union-attr]
                   f"{human(g.reference_weights)}, resident at every moment (reference_weights).")
    if s.fsdp:
        out.append("Under training.fsdp each decoding step gathers every layer's weights in turn; the generation's "
                   "gathered units are not modelled.")
    if explain:
        out += _arithmetic(est)
    return out


def _arithmetic(est: Estimate) -> list[str]:
    g = est.generation
    assert g is not None
    s = est.settings
    shape = shape_from_config(s.config)
    dt = DTYPE_BYTES[s.recipe.model.dtype]
    moment = ("the prefill: the cache of the prompts only, beside one layer's forward over every prompt token, "
              f"{human(g.prefill)}" if g.prefill_peak else
              f"the last token: the whole cache, beside one token's forward and one layer's keys or values copied "
              f"as the cache grows by concatenation, {human(g.last_token)} (the prefill's one layer over every "
              f"prompt token, {human(g.prefill)}, comes when the cache is {human(g.prefill_cache)})")
    lines = [
        f"KV cache: {shape.layers} layers x 2 (K, V) x {shape.kv_heads} kv heads x {shape.head_dim} x {dt} bytes = "
        f"{g.kv_per_token:,} bytes a token; x {g.sequences} sequences (training.batch_size x steps_per_generation) "
        f"x ({g.prompt_tokens} + {g.completion_tokens} - 1) tokens (data.max_seq_len - max_completion_length, the "
        f"longest prompt, + max_completion_length, less the last token, sampled and never fed back) = "
        f"{human(g.kv_cache)}.",
        f"Sampling logits: {g.sequences} sequences x {g.vocab:,} logits x {g.sampling_per_logit} bytes (the head's "
        f"output, its float32 copy and the probabilities, plus the filters' buffers) = {human(g.sampling_logits)}.",
        f"The generation's larger moment is {moment}.",
    ]
    if g.scoring is not None:
        lines.append(f"Scoring pass ({g.scoring_why}): one forward without gradients over the {g.sequences} "
                     f"sequences of {g.full_length} tokens, {human(g.scoring)} and {human(g.scoring_loss)} of chunked "
                     f"log-probs: {human(est.phases['scoring_pass'])} in all.")
    else:
        lines.append("No scoring pass: the generation is used within the step that sampled it (ratio 1) and β is 0, "
                     "so no log-probs are computed before training.")
    return lines
