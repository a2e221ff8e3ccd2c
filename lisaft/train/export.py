"""The final export: RUN/final, a Hugging Face folder that AutoModelForCausalLM loads."""

from __future__ import annotations

import os
import shutil

from lisaft import dist, runfiles
from lisaft.train.session import Session


def save_final(session: Session) -> None:
    """Written beside the run as .final.tmp and renamed into place: final/ is complete or absent.
    Under training.fsdp every rank sends its slices and rank 0 writes the gathered weights."""
    full = session.shards.full_state_dict() if session.shards is not None else None
    if not dist.is_main():
        dist.barrier()
        return
    final = session.run_dir / "final"
    tmp = session.run_dir / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    session.model.save_pretrained(tmp, safe_serialization=True, state_dict=full)
    session.tokenizer.save_pretrained(tmp)
    runfiles.give_files_the_usual_mode(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    dist.barrier()
