"""GRPO's arithmetic held to hand-worked numbers: advantages (group, batch, none, None rewards,
groups that do not spread), the four loss types' normalisers, the clip, the k3 KL, the masks."""

import math

import pytest
import torch

from lisaft.grpo.advantages import advantages, nanstd
from lisaft.grpo.loss import Clip, Normaliser, completion_mask, token_losses

NAN = math.nan


def test_group_advantages_are_reward_minus_group_mean_over_group_std():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])  # two groups of 2
    a = advantages(r, 2, "group")
    std0 = math.sqrt(0.5)  # Bessel: ((0.5² + 0.5²) / 1) ** 0.5
    assert a.values.tolist() == pytest.approx([0.5 / (std0 + 1e-4), -0.5 / (std0 + 1e-4), 0.0, 0.0])
    assert a.zero_std.tolist() == [False, False, True, True]


def test_batch_scaling_divides_by_the_whole_batchs_std_and_none_by_nothing():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    batch_std = torch.tensor([1.0, 0.0, 3.0, 3.0]).std().item()
    assert advantages(r, 2, "batch").values.tolist() == pytest.approx(
        [0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), 0.0, 0.0])
    a = advantages(r, 2, "none")
    assert a.values.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert a.zero_std.tolist() == [False, False, True, True]  # still said for "none"


def test_a_completion_no_reward_scored_is_left_out_of_its_group_and_gets_zero():
    r = torch.tensor([2.0, NAN, 0.0, 1.0])  # one group of 4: mean and std of 2, 0, 1
    a = advantages(r, 4, "group")
    assert a.values.tolist() == pytest.approx([1 / (1 + 1e-4), 0.0, -1 / (1 + 1e-4), 0.0])


def test_a_group_with_one_scored_completion_has_no_spread_to_learn_from():
    a = advantages(torch.tensor([5.0, NAN]), 2, "group")
    assert a.values.tolist() == [0.0, 0.0]


def test_nanstd_is_bessel_corrected_and_nan_below_two_values():
    assert nanstd(torch.tensor([1.0, 3.0, NAN])).item() == pytest.approx(math.sqrt(2))
    assert math.isnan(nanstd(torch.tensor([1.0, NAN])).item())


def test_masks_end_after_the_first_eos_and_truncated_completions_can_drop_out():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])  # EOS 2; row 1 never ends
    assert completion_mask(ids, [2], False).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert completion_mask(ids, [2], True).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    assert completion_mask(ids, [9, 7], False).tolist()[1] == [1, 1, 1, 0]  # any of several EOS ids


def _normaliser(loss_type, **kw):
    args = dict(grad_accum_steps=1, ranks=1, steps_per_generation=1, max_completion_length=4,
                generation_tokens=5)
    return Normaliser(loss_type, **(args | kw))


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # 3 and 2 active tokens


def test_each_loss_type_divides_by_its_own_count():
    assert _normaliser("grpo").micro_batch_loss(PER_TOKEN, MASK).item() == pytest.approx((6 / 3 + 11 / 2) / 2)
    assert _normaliser("bnpo").micro_batch_loss(PER_TOKEN, MASK).item() == pytest.approx(17 / 5)
    assert _normaliser("dr_grpo").micro_batch_loss(PER_TOKEN, MASK).item() == pytest.approx(17 / (2 * 4))
    assert _normaliser("dapo", generation_tokens=10).micro_batch_loss(PER_TOKEN, MASK).item() == \
        pytest.approx(17 / 10)


def test_accumulation_and_ranks_divide_as_trls_averages_do():
    # grpo, bnpo, dr_grpo: TRL divides by the accumulation steps and averages the ranks' gradients.
    for t in ("grpo", "bnpo", "dr_grpo"):
        one = _normaliser(t).micro_batch_loss(PER_TOKEN, MASK)
        assert _normaliser(t, grad_accum_steps=2, ranks=3).micro_batch_loss(PER_TOKEN, MASK).item() == \
            pytest.approx(one.item() / 6)
    # dapo: the generation batch's tokens (over ranks) rescaled by grad_accum / steps_per_generation.
    d = _normaliser("dapo", grad_accum_steps=2, steps_per_generation=4, generation_tokens=40, ranks=2)
    assert d.micro_batch_loss(PER_TOKEN, MASK).item() == pytest.approx(17 / (40 * 2 / 4))


def test_at_ratio_one_the_loss_is_minus_the_advantage_and_its_gradient_is_not_zero():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    t = token_losses(logps, None, torch.tensor([0.5]), Clip(0.2, 0.2))
    assert t.loss.tolist() == [[-0.5, -0.5]]
    t.loss.sum().backward()
    assert logps.grad.tolist() == [[-0.5, -0.5]]
    assert not t.clipped.any() and t.kl is None


def test_the_clip_takes_the_gradient_away_only_past_its_side():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.5, 0.5 against advantages +1, +1, -1, -1; clip [0.8, 1.28]
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]])).requires_grad_()
    adv = torch.tensor([1.0])
    for a, expect_loss, expect_clipped in ((1.0, [-1.28, -0.5, -1.28, -0.5], [True, False, True, False]),
                                           (-1.0, [1.5, 0.8, 1.5, 0.8], [False, True, False, True])):
        logps.grad = None
        t = token_losses(logps, old, adv * a, Clip(0.2, 0.28))
        assert t.loss[0].tolist() == pytest.approx(expect_loss)
        assert t.clipped[0].tolist() == expect_clipped
        t.loss.sum().backward()
        grad = logps.grad[0].tolist()
        for g, c, ratio in zip(grad, expect_clipped, (1.5, 0.5, 1.5, 0.5), strict=True):
            assert g == (0.0 if c else pytest.approx(-a * ratio))


def test_the_k3_kl_is_added_with_beta_and_is_zero_at_the_reference():
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.5]])
    t = token_losses(logps, None, torch.tensor([0.0]), Clip(0.2, 0.2), beta=0.1, ref_logps=ref)
    k3 = math.exp(0.5) - 0.5 - 1
    assert t.kl[0].tolist() == pytest.approx([0.0, k3])
    assert t.loss[0].tolist() == pytest.approx([0.0, 0.1 * k3])
    # The bias correction multiplies by the ratio: its value where old = current, its gradient always.
    old = logps - torch.tensor([[0.0, 0.2]])
    corrected = token_losses(logps, old, torch.tensor([0.0]), Clip(0.2, 0.2), 0.1, ref)
    plain = token_losses(logps, old, torch.tensor([0.0]), Clip(0.2, 0.2), 0.1, ref, bias_correction=False)
    assert corrected.kl[0, 1].item() == pytest.approx(plain.kl[0, 1].item() * math.exp(0.2))


def test_bf16_log_probs_clip_and_lose_as_float32_does_to_bf16_precision():
    ratios = torch.tensor([[1.5, 0.5, 1.0, 1.1]])
    adv = torch.tensor([1.0])
    f32 = token_losses(torch.log(ratios), torch.zeros(1, 4), adv, Clip(0.2, 0.2))
    b16 = token_losses(torch.log(ratios).bfloat16(), torch.zeros(1, 4, dtype=torch.bfloat16), adv, Clip(0.2, 0.2))
    assert b16.clipped.tolist() == f32.clipped.tolist() == [[True, False, False, False]]
    assert b16.loss.float()[0].tolist() == pytest.approx(f32.loss[0].tolist(), rel=1e-2)
