"""The chunked loss equals the plain one, and keeps far less for backward."""

import pytest
import torch

from lisaft import loss as loss_mod
from lisaft.loss import eval_sums, logits_loss_sum, token_loss_sum


def _model(kind: str):
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig

    common = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = Gemma2Config(**common, head_dim=8, final_logit_softcapping=5.0) if kind == "gemma2" \
        else LlamaConfig(**common, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (2, 24), generator=g)
    labels = ids.clone()
    labels[:, :7] = -100
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    labels[1, 20:] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_chunked_loss_and_gradients_match_the_plain_loss(kind, monkeypatch):
    model, batch = _model(kind), _batch()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    plain = logits_loss_sum(logits, batch["labels"])
    plain.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)  # 5 positions a chunk
    assert loss_mod.chunked(model, batch["input_ids"].numel())
    chunked = token_loss_sum(model, batch)
    chunked.backward()
    assert torch.allclose(chunked, plain, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, plain_grads[n], rtol=1e-4, atol=1e-6), n

    loss_c, n_c, correct_c = eval_sums(model, batch)
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 1 << 40)
    loss_p, n_p, correct_p = eval_sums(model, batch)
    assert n_c == n_p == int((batch["labels"][:, 1:] != -100).sum())
    assert correct_c == correct_p and loss_c == pytest.approx(loss_p, rel=1e-5)


def test_chunking_drops_the_float32_log_probs(monkeypatch):
    from lisaft.memory.measure import saved_activations

    model, batch = _model("llama"), _batch()
    with saved_activations(model) as plain:
        token_loss_sum(model, batch)
    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_ELEMENTS", 512 * 5)
    with saved_activations(model) as meter:
        token_loss_sum(model, batch)
    tokens = batch["input_ids"].numel()
    # The plain path keeps float32 log-probs of every position: 4 B x tokens x vocabulary.
    assert plain.bytes - meter.bytes >= 0.9 * 4 * tokens * 512
