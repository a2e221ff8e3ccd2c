"""The final export: RUN/final, a Hugging Face folder that AutoModelForCausalLM loads."""

from __future__ import annotations

import os
import shutil

from lisaft import run_folder as runfiles
from lisaft.distributed import dist
from lisaft.train.session import Session


def save_final(session: Session) -> None:
    """Written beside the run as .final.tmp and renamed into place: final/ is complete or absent.
    The parallel strategy writes the model (under FSDP every rank its slices, joined by rank 0)."""
    final = session.run_dir / "final"
    tmp = session.run_dir / ".final.tmp"
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    session.parallel.export(session.model, tmp)  # a LoRA run's: merged, or peft's adapter folder
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

