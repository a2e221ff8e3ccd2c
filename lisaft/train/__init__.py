"""The training run, one job per module:

    session.py   set-up: recipe -> model, data, units, optimizers, LISA controller (`Session`)
    step.py      one optimizer step over grad_accum_steps micro-batches (`StepResult`)
    evaluate.py  eval loss and token accuracy
    loop.py      steps, logging, evaluation, checkpoints, signals
    resume.py    which checkpoint to load, what a resume may change, the LR plan on resume
    commands.py  the `lisaft train` and `lisaft resume` entry points
    report.py    the banner, the end-of-run memory report, the out-of-memory message
    export.py    the final Hugging Face folder

A name here is never a module's: `lisaft.train.resume` is resume.py (the `lisaft resume` entry
point is `lisaft.train.commands.resume`), `lisaft.train.evaluate` is evaluate.py.
"""

from lisaft.metrics.phases import Phases
from lisaft.train.commands import train
from lisaft.train.session import Session, build_session
from lisaft.train.step import StepResult, train_step

__all__ = ["Phases", "Session", "StepResult", "build_session", "train", "train_step"]
