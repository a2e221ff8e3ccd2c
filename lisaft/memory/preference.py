"""The estimator's preference terms (a recipe with a `preference` section), said for people and
scripts: the pairs or rows, the log-probs chunked over the vocabulary, the reference pass and its
cache, KTO's KL pass.

- Pairs: the chosen and the rejected answer of each pair go through one forward as two rows
  (train/objectives/pairs.py), so a micro-batch of training.batch_size pairs holds twice as many
  sequences: activations, the loss's buffers, offloaded inputs and the embedding's sparse rows
  are counted for Settings.sequences. Pairs are never packed, so rows are padded to the longest.
- Unpaired feedback (KTO): a micro-batch of training.batch_size rows is as many sequences with
  gradients; before the first micro-batch each step runs its KL sequences (a row's prompt with
  another row's completion) through a forward without gradients: the `kl_pass` moment.
- Log-probs: lisaft/model/loss.py token_nll, the per-token form of the chunked token loss, holds
  one chunk's float32 log-probs (and their gradient) at a time above 2^24 logits, never the
  [2·B·T·V] float32 logits of every position at once.
- The reference pass (a loss with a reference: dpo, ipo, kto): the reference's log-probs of every
  pair (KTO: of every row's completion and KL sequence, twice a micro-batch's sequences), one pass before step 1,
  under no_grad and before the optimizer is built: the estimate's `reference_pass` moment
  (lisaft/memory/estimate.py), counted in the peak like every other moment.
- The reference cache: two float64 sums a pair or row, kept with each as a list of two Python
  floats and written into each checkpoint's state.json; host memory, never the GPU's.
"""

from __future__ import annotations

import sys

from lisaft.memory.activations import FP32, loss_chunk_tokens, shape_from_config
from lisaft.memory.estimate import SETUP_PHASES, Estimate

# A pair's cached sums in host memory: a list of two Python floats (CPython's sizes, measured here).
CACHE_BYTES_PER_PAIR = sys.getsizeof([0.0, 0.0]) + 2 * sys.getsizeof(0.0)
# ... and in a checkpoint's state.json: "[a, b]" with float64's longest repr (24 characters) each.
CHECKPOINT_BYTES_PER_PAIR = 2 * 24 + 4
# How many pairs the text quotes the cache for.
PAIRS_QUOTED = 100_000


def preference_summary(est: Estimate) -> dict | None:
    """The preference terms of `est` (None for an SFT recipe): what --json's `preference` holds."""
    s = est.settings
    pref = s.recipe.preference
    if pref is None:
        return None
    shape = shape_from_config(s.config)
    tokens = s.sequences * s.recipe.data.max_seq_len
    chunk = loss_chunk_tokens(shape, tokens)
    return {
        "loss": pref.loss,
        "pairs_per_micro_batch": s.recipe.training.batch_size,
        "sequences_per_micro_batch": s.sequences,
        "loss_chunk_positions": chunk,  # null: unchunked, every position's logits at once
        "unchunked_logits_bytes": tokens * shape.vocab * FP32,  # what chunking avoids
        "reference_pass_bytes": est.phases.get("reference_pass"),  # null without a reference pass
        "kl_pass_bytes": est.phases.get("kl_pass"),  # KTO's forward over the KL sequences; null for pairs
        "step_peak_bytes": max(v for k, v in est.phases.items() if k not in SETUP_PHASES),
        "reference_cache_bytes_per_pair": CACHE_BYTES_PER_PAIR if s.reference_pass else 0,
        "reference_checkpoint_bytes_per_pair": CHECKPOINT_BYTES_PER_PAIR if s.reference_pass else 0,
    }


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB"


def preference_lines(est: Estimate) -> list[str]:
    """The three preference terms explained, for the text output; none for an SFT recipe."""
    p = preference_summary(est)
    if p is None:
        return []
    seq = est.settings.recipe.data.max_seq_len
    pairs, rows = p["pairs_per_micro_batch"], p["sequences_per_micro_batch"]
    vocab = shape_from_config(est.settings.config).vocab
    chunk = (f"chunked over the {vocab:,}-token vocabulary, {p['loss_chunk_positions']} positions at a time, so the "
             f"{_gib(p['unchunked_logits_bytes'])} of [2·B·T·V] float32 logits never exist"
             if p["loss_chunk_positions"] else f"unchunked: {_gib(p['unchunked_logits_bytes'])} of float32 logits, "
             "under the 2^24 elements where lisaft chunks them")
    if p["kl_pass_bytes"] is None:
        out = [f"Pairs (preference.loss {p['loss']}): a micro-batch of {pairs} pair{'s' * (pairs > 1)} is {rows} "
               f"sequences of up to {seq} tokens, chosen and rejected in one forward; activations and the loss's "
               f"buffers above count {rows} sequences. Log-probs are {chunk}."]
    else:
        out = [f"Unpaired feedback (preference.loss {p['loss']}): a micro-batch of {pairs} row{'s' * (pairs > 1)} "
               f"is {rows} sequences of up to {seq} tokens with gradients; each step first runs its rows' KL "
               f"sequences through a forward without gradients ({_gib(p['kl_pass_bytes'])}, the kl_pass moment). "
               f"Log-probs are {chunk}."]
    if p["reference_pass_bytes"] is None:
        out.append(f"No reference pass: {p['loss']} compares the policy's own log-probs, nothing runs before "
                   "step 1 and nothing is cached.")
        return out
    ref, step = p["reference_pass_bytes"], p["step_peak_bytes"]
    where = (f"below the training step's {_gib(step)}" if ref <= step else
             f"above the training step's {_gib(step)}: the pass is this run's peak")
    cache = PAIRS_QUOTED * (p["reference_cache_bytes_per_pair"] + p["reference_checkpoint_bytes_per_pair"])
    each = "row and its KL sequence" if p["kl_pass_bytes"] else "pair"
    out.append(f"Reference pass ({p['loss'].upper()}'s reference log-probs of every {each}, once, before step 1): "
               f"{_gib(ref)}, "
               f"{where}; no gradients and no optimizer state yet, one layer's forward and the loss's chunk "
               "(the reference_pass moment).")
    out.append(f"Reference cache: two float64 sums a pair or row, {p['reference_cache_bytes_per_pair']} B in host "
               f"memory and up to {p['reference_checkpoint_bytes_per_pair']} B in each checkpoint's state.json: "
               f"{cache / 1024**2:.1f} MiB for {PAIRS_QUOTED:,}, none on the GPU.")
    return out
