"""The final export: RUN/final, a Hugging Face folder that AutoModelForCausalLM loads."""

from __future__ import annotations

import copy
import os
import shutil

from lisaft import run_folder as runfiles
from lisaft.distributed import dist
from lisaft.train.session import Session


def save_final(session: Session) -> None:
    """Written beside the run as .final.tmp and renamed into place: final/ is complete or absent.
    Under training.fsdp every rank writes its slices and rank 0 joins them tensor by tensor."""
    final = session.run_dir / "final"
    tmp = session.run_dir / ".final.tmp"
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if session.shards is not None:
        session.shards.write_hf_weights(tmp)
        if dist.is_main():
            _write_config(session.model, tmp)
    elif dist.is_main() and session.adapters is not None:
        from lisaft.model.lora import save_final as save_lora

        save_lora(session.model, session.adapters, session.recipe, tmp)
    elif dist.is_main():
        session.model.save_pretrained(tmp, safe_serialization=True)
    if not dist.is_main():
        dist.barrier()
        return
    session.tokenizer.save_pretrained(tmp)
    runfiles.give_files_the_usual_mode(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dist.barrier()


def _write_config(model, folder) -> None:
    """config.json (and generation_config.json) as save_pretrained writes them beside weights."""
    config = copy.deepcopy(model.config)
    from torch.distributed.fsdp import FSDPModule

    # fully_shard swapped the model's class for a subclass named FSDP<class>: name the model's own.
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config.architectures = [cls.__name__]
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
