import os

import pytest
import torch

# Two cores: at most two intra-op threads per test process keeps timings stable and leaves room
# for subprocess-based tests; under pytest-xdist (pyproject's addopts) each worker takes its share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)


def pytest_collection_modifyitems(config, items):
    # One rule for every CUDA-only test: mark it `gpu` and it skips where torch sees no GPU.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker gpu)")
    for item in items:
        # The marker, not item.keywords: keywords hold every folder name above the test too,
        # and a checkout in a folder named gpu would skip the whole suite.
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
