"""The CUDA caching allocator's setting, chosen before torch initialises CUDA.

lisaft turns on expandable segments unless the user configured the allocator: a segment then
grows and shrinks in place, so memory freed by one phase of a step (activations, recompute
buffers) is reused by the next phase's differently sized tensors (gradients) instead of being
held as cached blocks that fit nothing. docs/memory.md gives the measured effect.
"""

from __future__ import annotations

import os

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_NEW = "PYTORCH_ALLOC_CONF"  # the name newer PyTorch reads first
EXPANDABLE = "expandable_segments:True"


def _user_setting(environ) -> str | None:
    return environ.get(ALLOC_CONF_NEW, environ.get(ALLOC_CONF))


def configure_cuda_allocator(environ=os.environ) -> bool:
    """Set expandable segments unless the user set the allocator; returns whether it did. The
    allocator reads the variable once, when CUDA is first used: call this before that."""
    if _user_setting(environ) is not None:
        return False
    environ[ALLOC_CONF] = EXPANDABLE
    return True


def expandable_segments(environ=os.environ) -> bool:
    """Whether a lisaft process started with `environ` runs with expandable segments: on when
    the user set nothing (lisaft sets it), else as their setting says."""
    conf = _user_setting(environ)
    if conf is None:
        return True
    options = {k.strip(): v.strip() for k, _, v in (o.partition(":") for o in conf.split(","))}
    return options.get("expandable_segments", "False").lower() == "true"
