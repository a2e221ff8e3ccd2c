"""The training run, one job per module:

    session.py   set-up: recipe -> model, data, units, optimizers, LISA controller (`Session`)
    step.py      one optimizer step over grad_accum_steps micro-batches (`StepResult`)
    evaluate.py  eval loss and token accuracy
    loop.py      steps, logging, evaluation, checkpoints, signals
    resume.py    which checkpoint to load, what a resume may change, the LR plan on resume
    commands.py  the `lisaft train` and `lisaft resume` entry points
    report.py    the banner, the end-of-run memory report, the out-of-memory message
    export.py    the final Hugging Face folder
"""

from lisaft.train.commands import resume, train
from lisaft.train.evaluate import evaluate
from lisaft.train.session import Session, build_session
from lisaft.train.step import Phases, StepResult, train_step

__all__ = ["Phases", "Session", "StepResult", "build_session", "evaluate", "resume", "train", "train_step"]
