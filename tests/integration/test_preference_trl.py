"""SimPO and ORPO against TRL's trainers (trl.experimental's CPOTrainer and ORPOTrainer) on the
same pairs, tokenizer and initial model: what is the same and what differs (docs/preference.md).
TRL's loss is its trainer's own get_batch_loss_metrics on one batch of every pair (the means do
not depend on the order)."""

import tempfile
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
# slow: TRL's experimental trainers import most of TRL and datasets (seconds on two cores).
pytestmark = pytest.mark.slow

from lisaft.config.schema import PreferenceSection  # noqa: E402
from lisaft.data.formats import data_format  # noqa: E402
from lisaft.data.read import Rows  # noqa: E402
from lisaft.model.preference import PairObjective, collate_pairs, sequence_logps  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tokenizer"
# Chosen answers of three lengths: a mean over pairs and one over tokens differ here.
UNEVEN = [{"prompt": "Reverse abc: ", "chosen": "cba", "rejected": "abcd"},
          {"prompt": "Reverse hello: ", "chosen": "olleh", "rejected": "hello there"},
          {"prompt": "Sort dcbaxyz: ", "chosen": "abcdxyz", "rejected": "dcb"}]
EVEN = [{"prompt": "Reverse abc: ", "chosen": "cba", "rejected": "abcd"},
        {"prompt": "Reverse hel: ", "chosen": "leh", "rejected": "hello there"},
        {"prompt": "Sort dcb: ", "chosen": "bcd", "rejected": "dc"}]


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval(), tok


def _batch(rows, tok):
    examples = data_format("preference").examples(Rows(rows, "data.train", "t", "line"), tok, None, {})
    return collate_pairs(examples, tok.pad_token_id)


@torch.no_grad()
def lisaft_loss(setup, rows, **section) -> float:
    model, tok = setup
    losses, _ = PairObjective(PreferenceSection(**section)).losses(model, _batch(rows, tok))
    return losses.mean().item()


@torch.no_grad()
def chosen_nll(setup, rows) -> tuple[float, float]:
    """The chosen answers' NLL: each answer's mean over its tokens then the mean over pairs
    (lisaft's), and the mean over all chosen tokens of the batch (TRL's)."""
    model, tok = setup
    logps, counts = sequence_logps(model, _batch(rows, tok))
    n = len(rows)
    return -(logps[:n] / counts[:n]).mean().item(), -(logps[:n].sum() / counts[:n].sum()).item()


@torch.no_grad()
def trl_loss(setup, rows, trainer: str, **config) -> float:
    from datasets import Dataset

    if trainer == "cpo":
        from trl.experimental.cpo import CPOConfig as Config
        from trl.experimental.cpo import CPOTrainer as Trainer
    else:
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    model, tok = setup
    with tempfile.TemporaryDirectory() as out:
        args = Config(output_dir=out, per_device_train_batch_size=len(rows), report_to=[], use_cpu=True,
                      max_length=64, remove_unused_columns=False, **config)
        t = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
        loss, _ = t.get_batch_loss_metrics(model, next(iter(t.get_train_dataloader())))
    return loss.item()


def test_simpo_is_trl_cpo_simpo_without_its_nll_term(setup):
    ours = lisaft_loss(setup, UNEVEN, loss="simpo", beta=2.0, gamma=0.5)
    pure = trl_loss(setup, UNEVEN, "cpo", loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=0.0)
    assert ours == pytest.approx(pure, rel=1e-5)
    # CPOConfig's default cpo_alpha=1.0 adds the chosen tokens' NLL (CPO's behaviour-cloning term):
    # TRL's loss_type="simpo" alone is CPO-SimPO, not the SimPO paper's loss.
    default = trl_loss(setup, UNEVEN, "cpo", loss_type="simpo", beta=2.0, simpo_gamma=0.5)
    assert default == pytest.approx(ours + chosen_nll(setup, UNEVEN)[1], rel=1e-5)
    assert default - ours > 1.0  # ln(vocabulary) per token on an untrained model


@torch.no_grad()
def trl_orpo_nll(setup, rows) -> float:
    """TRL's ORPO NLL: over every token of the chosen sequences, prompt included (its comment:
    "orpo chosen nll loss is computed over the full prompt and response"), mean over the batch's tokens."""
    from lisaft.model.loss import token_nll

    model, tok = setup
    b = _batch(rows, tok)
    chosen = {k: v[: len(rows)] for k, v in b.items() if k in ("input_ids", "attention_mask")}
    labels = chosen["input_ids"].masked_fill(chosen["attention_mask"] == 0, -100)
    nll = token_nll(model, {**chosen, "labels": labels})
    return (nll.sum() / (labels[:, 1:] != -100).sum()).item()


def test_orpo_is_trl_orpo_but_for_the_nll_term(setup):
    """The odds-ratio term is TRL's; the NLL term is lisaft's own: each chosen answer's mean over
    its tokens (EOS included), then the mean over pairs."""
    for rows in (EVEN, UNEVEN):
        ours, theirs = lisaft_loss(setup, rows, loss="orpo", beta=0.1), trl_loss(setup, rows, "orpo", beta=0.1)
        per_pair_answer = chosen_nll(setup, rows)[0]
        assert ours - theirs == pytest.approx(per_pair_answer - trl_orpo_nll(setup, rows), rel=1e-4, abs=1e-6)
    assert chosen_nll(setup, UNEVEN)[0] != pytest.approx(chosen_nll(setup, UNEVEN)[1], rel=1e-4)
