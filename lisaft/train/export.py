"""The final export: RUN/final, a Hugging Face folder that AutoModelForCausalLM loads."""

from __future__ import annotations

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
    if session.adapters is not None:  # lora.enabled: merged, or peft's adapter folder (lora.export)
        if dist.is_main():
            from lisaft.model.lora import save_final as save_lora

            save_lora(session.model, session.adapters, session.recipe, tmp)
    else:
        session.parallel.export(session.model, tmp)
    if not dist.is_main():
        dist.barrier()
        return
    save_tokenizer = getattr(session.tokenizer, "save_pretrained", None)
    assert save_tokenizer is not None, "a run that exports loaded a transformers tokenizer"
    save_tokenizer(tmp)
    runfiles.give_files_the_usual_mode(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dist.barrier()

