"""Other libraries' output that tells a lisaft user nothing, silenced unless `lisaft -v`.

Each rule names one message or bar, so anything else those libraries say still shows. Applied
once per process (every torchrun rank runs the CLI), before the libraries are imported.
"""

from __future__ import annotations

import logging
import os
import warnings

_verbose = False


def verbose() -> bool:
    return _verbose


def _drop_kernels_hint(record: logging.LogRecord) -> bool:
    # bitsandbytes logs this at import on CPUs with AVX512-BF16 when the optional `kernels`
    # package is absent; it concerns 4-bit matmuls, which lisaft never runs.
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


def configure(show_everything: bool) -> None:
    global _verbose
    _verbose = show_everything
    if show_everything:
        return
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_drop_kernels_hint)
    # "Loading weights 100%|...": a bar for reading a local folder in about a second. The
    # variables are read when transformers/huggingface_hub are imported; a user's own setting wins.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    # Advisory warnings about generation defaults and the like; errors still show.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # peft reads the model's is_gradient_checkpointing, which transformers deprecates with a
    # FutureWarning on every LoRA run; neither is the user's to change.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
