"""Run under torchrun by test_fsdp.py: `python -m lisaft` with the loss's chunk size
(loss.LOSS_CHUNK_ELEMENTS, logits per chunk) set to argv[1], so the tiny run's vocabulary takes
the chunked head and loss (lisaft/model/loss.py) that only a vocabulary of hundreds of thousands
would take at the library's size, at a tiny model's cost."""

import sys

from lisaft.env import configure_process

configure_process()  # as `python -m lisaft` does, before torch is imported

from lisaft.cli import main  # noqa: E402
from lisaft.model import loss  # noqa: E402

loss.LOSS_CHUNK_ELEMENTS = int(sys.argv.pop(1))
main()
