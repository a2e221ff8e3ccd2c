"""Scores and memory readings, the same for every arm.

Token accuracy is lisaft's own eval measure (`lisaft.model.loss.eval_sums`: teacher-forced argmax on the
response tokens), computed here over a fixed list of examples so that a LoRA or BAdam model is
scored by exactly the code that scores a lisaft model. Exact match decodes greedily from the
prompt and counts an answer right when the model emits exactly the reference response and then
EOS.
"""

from __future__ import annotations

import itertools
import re

import torch

from lisaft.data.collate import IGNORE_INDEX, collate
from lisaft.data.order import eval_index_batches
from lisaft.model.loss import eval_sums

EVAL_BATCH = 50
GENERATE_BATCH = 64


@torch.no_grad()
def token_accuracy(model, examples: list[dict], pad_id: int) -> dict:
    was_training = model.training
    model.eval()
    loss = tokens = correct = 0.0
    for idx in eval_index_batches(len(examples), EVAL_BATCH):
        batch = collate([examples[i] for i in idx], pad_id)
        l, n, c = eval_sums(model, batch)
        loss, tokens, correct = loss + l, tokens + n, correct + c
    model.train(was_training)
    return {"loss": loss / max(tokens, 1), "token_accuracy": correct / max(tokens, 1)}


def _split(example: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, reference response ids ending in EOS) of an instruction example."""
    first = next(i for i, lab in enumerate(example["labels"]) if lab != IGNORE_INDEX)
    return example["input_ids"][:first], example["input_ids"][first:]


@torch.no_grad()
def exact_match(model, examples: list[dict], pad_id: int, eos_id: int) -> float:
    """Fraction of examples whose greedy continuation is exactly the reference response + EOS."""
    was_training = model.training
    model.eval()
    pairs = [_split(ex) for ex in examples]
    new_tokens = max(len(target) for _, target in pairs)
    right = 0
    # Prompts of one length batch without padding, so no attention mask or position shift can
    # make a batched answer differ from a one-by-one answer.
    by_len = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]))
    for _, group in itertools.groupby(by_len, key=lambda i: len(pairs[i][0])):
        group = list(group)
        for lo in range(0, len(group), GENERATE_BATCH):
            idx = group[lo:lo + GENERATE_BATCH]
            prompts = torch.tensor([pairs[i][0] for i in idx], dtype=torch.long)
            out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                 max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                                 eos_token_id=eos_id, pad_token_id=pad_id)
            answers = out[:, prompts.shape[1]:].tolist()
            for i, answer in zip(idx, answers):
                target = pairs[i][1]
                right += answer[:len(target)] == target
    model.train(was_training)
    return right / len(pairs)


def reset_peak_rss() -> bool:
    """Start a new resident-set high-water mark for this process (Linux: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """Peak resident set since the last reset_peak_rss (VmHWM); None where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
