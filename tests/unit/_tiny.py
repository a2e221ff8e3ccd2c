"""A tiny Llama for the LISA and optimizer unit tests."""

import torch


def tiny(seed: int = 0, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    # hidden 64: the projection matrices reach bitsandbytes' 4096-element threshold for 8-bit state.
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)
