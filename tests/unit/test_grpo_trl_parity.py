"""lisaft's GRPO loss against TRL 1.16's GRPOTrainer._compute_loss on the same tiny model, the
same fixed prompts, completions and advantages: every parameter's gradient equal (rel ≤ 1e-5 in
float32) for each loss type, at ratio 1 (μ = 1), with ratios away from 1 (clipping active) and
with β > 0. Needs TRL (the bench extra); slow: importing TRL takes over 5 s on 2 cores."""

import pytest
import torch

from lisaft.grpo.loss import Clip, Normaliser, completion_logps, token_losses
from tests.unit._tiny import tiny

pytestmark = pytest.mark.slow

PROMPTS = torch.tensor([[1, 5, 6], [0, 1, 9], [1, 5, 6], [0, 1, 9]])
COMPLETIONS = torch.tensor([[7, 8, 2, 0], [9, 9, 9, 9], [3, 2, 0, 0], [4, 4, 4, 4]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]])
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])
TEMPERATURE, MAX_COMPLETION = 0.7, 6


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.integration.conftest import TOKENIZER

    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
                      report_to=[], use_cpu=True, bf16=False, epsilon_high=0.28)
    return GRPOTrainer(model=tiny(), reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
                       args=args, train_dataset=Dataset.from_list([{"prompt": "ab"}] * 4),
                       processing_class=AutoTokenizer.from_pretrained(TOKENIZER))


def _old_and_ref():
    g = torch.Generator().manual_seed(3)
    # Ratios from e^-0.5 to e^0.5: many beyond [0.8, 1.28], so the clip is active on both sides.
    return (torch.rand(4, 4, generator=g) - 0.5, torch.rand(4, 4, generator=g) - 0.5)


def _trl_gradients(trainer, loss_type, shifts, beta):
    model = trainer.model
    model.zero_grad()
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.current_gradient_accumulation_steps = 1
    inputs = {"prompt_ids": PROMPTS, "prompt_mask": (PROMPTS != 0).long(), "completion_ids": COMPLETIONS,
              "completion_mask": MASK, "advantages": ADVANTAGES, "num_items_in_batch": MASK.sum()}
    if shifts is not None:
        logps = _logps(model).detach()
        inputs["old_per_token_logps"] = logps + shifts[0]
        inputs["ref_per_token_logps"] = logps + shifts[1]
    model.train()
    trainer._compute_loss(model, inputs).backward()
    return [p.grad.clone() for p in model.parameters()]


def _logps(model):
    ids = torch.cat([PROMPTS, COMPLETIONS], 1)
    return completion_logps(model, ids, torch.cat([(PROMPTS != 0).long(), MASK], 1), 4, TEMPERATURE)


def _our_gradients(loss_type, shifts, beta):
    model = tiny()
    logps = _logps(model)
    old = ref = None
    if shifts is not None:
        old, ref = logps.detach() + shifts[0], logps.detach() + shifts[1]
    t = token_losses(logps, old, ADVANTAGES, Clip(0.2, 0.28), beta, ref)  # TRL's bias-corrected KL
    loss = Normaliser(loss_type, 1, 1, 1, MAX_COMPLETION, int(MASK.sum())).micro_batch_loss(t.loss, MASK.float())
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], t.clipped


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("case", ["ratio one", "ratios away from one", "beta"])
def test_the_gradient_equals_trls(trainer, loss_type, case):
    shifts = None if case == "ratio one" else _old_and_ref()
    beta = 0.04 if case == "beta" else 0.0
    ours, clipped = _our_gradients(loss_type, shifts, beta)
    if case != "ratio one":
        assert clipped.any() and not clipped.all()
    theirs = _trl_gradients(trainer, loss_type, shifts, beta)
    for a, b in zip(ours, theirs, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1e-12)
