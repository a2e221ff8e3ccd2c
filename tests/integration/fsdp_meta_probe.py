"""Run under torchrun by test_fsdp.py: load a saved model shard by shard (lisaft.distributed.fsdp.load_sharded)
and write what each rank holds, and whether the model was still on the meta device when sharded."""

import sys

import torch
import torch.distributed.fsdp as fsdp_api

from lisaft.config.schema import ModelSection
from lisaft.distributed import dist
from lisaft.distributed.fsdp import load_sharded

folder, dtype, out = sys.argv[1:4]
dist.init_from_env()
seen_on_meta = []
real_fully_shard = fsdp_api.fully_shard


def recording_fully_shard(module, **kwargs):
    seen_on_meta.append(all(p.is_meta for p in module.parameters()))
    return real_fully_shard(module, **kwargs)


fsdp_api.fully_shard = recording_fully_shard
section = ModelSection(name_or_path=folder, dtype=dtype, attention="sdpa", gradient_checkpointing=True)
model, _ = load_sharded(section, torch.device("cpu"))
torch.save({"seen_on_meta": seen_on_meta,
            "settings": {"checkpointing": all(layer.gradient_checkpointing for layer in model.model.layers),
                         "use_cache": model.config.use_cache, "training": model.training,
                         "attention": model.config._attn_implementation},
            "local": {n: p.to_local().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight},
           f"{out}-{dist.rank()}.pt")
dist.shutdown()
