"""Sampling on the policy (seeded by the run's position, left-padded, the model's mode and the
global RNG left as they were) and the completion log-probs the loss uses, chunked or not."""

import pytest
import torch

from lisaft.config.grpo import GrpoSection
from lisaft.grpo.generation import left_padded, sample, sampling_seed
from lisaft.grpo.loss import completion_logps
from lisaft.model import loss as model_loss
from tests.unit._tiny import tiny

GRPO = GrpoSection(reward_funcs=["exact_match"], num_generations=2, max_completion_length=6, temperature=0.9,
                   top_k=20, top_p=0.95)
PROMPTS = [[1, 5, 6], [1, 5, 6], [1, 9], [1, 9]]


def test_prompts_are_padded_on_the_left():
    ids, mask = left_padded([[1, 2, 3], [4]], 0, "cpu")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_a_generation_is_a_pure_function_of_its_seeds_and_leaves_the_run_as_it_was():
    model = tiny()
    model.train()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    seeds = [sampling_seed(0, 5, 0), sampling_seed(0, 5, 1)]
    a = sample(model, PROMPTS, GRPO, 0, [2], seeds)
    assert torch.equal(torch.get_rng_state(), before) and model.training
    b = sample(model, PROMPTS, GRPO, 0, [2], seeds)
    other_groups = sample(model, PROMPTS, GRPO, 0, [2], [sampling_seed(0, 5, 2), sampling_seed(0, 5, 3)])
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, other_groups.completion_ids)
    assert a.completion_ids.shape == (4, 6) and a.prompt_mask.tolist()[2] == [0, 1, 1]
    assert sampling_seed(0, 5, 0) != sampling_seed(0, 6, 0) != sampling_seed(1, 5, 0)


def test_a_group_draws_the_same_completions_whichever_batch_it_is_sampled_in():
    """Two ranks equal one process at twice the batch: the second group alone, sampled as the other
    rank would, gives the rows it gave in the whole batch."""
    model = tiny()
    seeds = [sampling_seed(0, 5, 0), sampling_seed(0, 5, 1)]
    whole = sample(model, PROMPTS, GRPO, 0, [2], seeds)
    alone = sample(model, PROMPTS[2:], GRPO, 0, [2], seeds[1:])
    assert torch.equal(alone.completion_ids, whole.completion_ids[2:])


def test_the_seeded_draw_follows_the_warped_distribution():
    """Thousands of one-token draws from one prompt: each token's share is its probability after
    temperature, top_k and top_p (transformers' warpers), and tokens they remove are never drawn."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    model = tiny()
    one_token = GRPO.model_copy(update={"max_completion_length": 1})
    n = 4000
    drawn = sample(model, [[1, 5, 6]] * n, one_token, 0, [2], [sampling_seed(0, 0, 0)]).completion_ids[:, 0]
    with torch.no_grad():
        scores = model(input_ids=torch.tensor([[1, 5, 6]])).logits[:, -1].float()
    for warp in (TemperatureLogitsWarper(0.9), TopKLogitsWarper(20), TopPLogitsWarper(0.95)):
        scores = warp(None, scores)
    want = scores.softmax(-1)[0]
    seen = torch.bincount(drawn, minlength=want.numel()).double() / n
    assert seen[want == 0].sum() == 0
    assert (seen - want).abs().max() < 0.03  # about 4 standard errors of a share near 1/20


def _reference_logps(model, ids, mask, c, temperature):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp[:, -c:]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_completion_log_probs_divide_by_the_temperature_chunked_or_not(monkeypatch, dtype, tol):
    model = tiny().to(dtype)
    ids, mask = left_padded([[1, 5, 6, 7, 8], [1, 9, 4, 2]], 0, "cpu")
    want = _reference_logps(model, ids, mask, 2, 0.7)
    whole = completion_logps(model, ids, mask, 2, 0.7)
    monkeypatch.setattr(model_loss, "LOSS_CHUNK_ELEMENTS", 3 * 128)  # 3 positions a chunk
    assert model_loss.chunked(model, ids.numel())
    chunks = completion_logps(model, ids, mask, 2, 0.7)
    torch.testing.assert_close(whole, want, rtol=tol, atol=tol)
    torch.testing.assert_close(chunks, want, rtol=tol, atol=tol)


def test_chunked_log_probs_carry_the_same_gradient():
    model = tiny()
    ids, mask = left_padded([[1, 5, 6, 7, 8], [1, 9, 4, 2]], 0, "cpu")
    completion_logps(model, ids, mask, 2, 0.7).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_loss, "LOSS_CHUNK_ELEMENTS", 3 * 128)
        completion_logps(model, ids, mask, 2, 0.7).sum().backward()
    for w, p in zip(want, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5)
