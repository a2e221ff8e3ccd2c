"""The command line: parse, call one function, render. No training logic lives here."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import List, Optional, get_args

import typer

from lisaft.config.optimizers import OPTIMIZERS
from lisaft.config.schema import CADENCE_KEYS, DataSection
from lisaft.errors import LisaftError

FORMAT_NAMES: tuple[str, ...] = get_args(DataSection.model_fields["format"].annotation)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help: it wraps to the terminal (80 columns and less) and shows a flag as a flag.
    rich_markup_mode=None,
    help="Fine-tune causal language models on one GPU: LISA, lean optimizers, exact resume.",
)
# Flags take no value: each gives metavar="", which keeps help from showing one.
SET_HELP = "Override a recipe key: --set training.max_steps=100 (repeatable)."


def _version(value: bool) -> None:
    if value:
        from lisaft import __version__

        typer.echo(f"lisaft {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Show other libraries' warnings "
                                 "and progress bars too.", metavar=""),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit.", metavar=""),
) -> None:
    import warnings

    from lisaft.env import quiet

    quiet.configure(show_everything=verbose)
    # Here as well as in main(): the app is also run without main() (tests, `python -m lisaft`).
    warnings.showwarning = _one_line_warning


# How long a rank other than 0 waits before it reports a refusal (rank 0's line comes first).
RANK_WAIT_S = 10.0


def _fail(message: str, code: int = 2) -> None:
    import os

    from rich.console import Console
    from rich.markup import escape

    # Under torchrun every rank refuses the same recipe: rank 0 says it once. torchrun stops every
    # rank as soon as one fails, so another rank that left first could stop rank 0 before it
    # printed: it waits, and says the refusal itself only if it is still running then (a refusal
    # of its own, such as its device). A run that failed (exit 1: a write, memory) may fail on one
    # rank only, so every rank reports that at once.
    rank = int(os.environ.get("RANK", "0") or 0)
    if code == 2 and rank > 0:
        import time

        time.sleep(RANK_WAIT_S)
        message = f"rank {rank}: {message}"
    # soft_wrap: the message stays one line however narrow the terminal, so it can be grepped.
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def _exits(command: Callable[..., int | None]) -> Callable[..., None]:
    """A command's one exit: its return code, or a LisaftError as one `error:` line and its code."""

    @functools.wraps(command)
    def run(*args, **kwargs) -> None:
        try:
            code = command(*args, **kwargs)
        except LisaftError as e:
            _fail(str(e), e.exit_code)
        raise typer.Exit(code or 0)

    return run


@app.command()
@_exits
def train(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="Recipe YAML."),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run already in output_dir.",
                                   metavar=""),
    force: bool = typer.Option(False, "--force", help="With --overwrite: go on although output_dir "
                               "holds files lisaft did not write (they are left alone).", metavar=""),
) -> int:
    """Fine-tune as RECIPE says."""
    from lisaft.train import train as run_train

    return run_train(recipe, overrides=set_ or [], overwrite=overwrite, force=force)


@app.command()
@_exits
def resume(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="Run directory of a stopped or crashed run."),
    max_steps: Optional[int] = typer.Option(
        None, "--max-steps", metavar="N", help="Train to step N instead; the LR stays on its saved curve."),
    reschedule: bool = typer.Option(
        False, "--reschedule", help="Re-plan the LR decay from the current step to --max-steps.", metavar=""),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", metavar="KEY=VALUE",
        help=f"Change a key a resume may change: {', '.join(CADENCE_KEYS)}. Others alter the run "
        "and are refused."),
) -> int:
    """Continue a run from its newest complete checkpoint, exactly."""
    from lisaft.train.commands import resume as run_resume

    return run_resume(run_dir, max_steps=max_steps, overrides=set_ or [], reschedule=reschedule)


@app.command()
@_exits
def data(
    recipe: Path = typer.Argument(..., metavar="RECIPE", help="Recipe YAML."),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    examples: int = typer.Option(3, "--examples", metavar="N", help="Train examples to show."),
    json_out: bool = typer.Option(False, "--json", help="Print the audit as JSON.", metavar=""),
) -> int:
    """Audit RECIPE's data as it will train: examples, lengths, loss tokens."""
    from lisaft.grpo.audit import data_audit
    from lisaft.metrics.data_report import data_command

    return data_command(recipe, set_ or [], json_out=json_out, shown=examples, stage_audit=data_audit)


@app.command("estimate-memory")
@_exits
def estimate_memory(
    recipe: Optional[Path] = typer.Argument(None, metavar="RECIPE",
                                            help="Recipe YAML to start from (flags override it)."),
    model: Optional[str] = typer.Option(None, "--model", metavar="NAME",
                                        help="Catalogue name (llama-3.1-8b), folder or hub id."),
    optimizer: Optional[str] = typer.Option(
        None, "--optimizer", metavar="NAME",
        help=f"One of {', '.join(OPTIMIZERS)}."),
    lisa_layers: Optional[int] = typer.Option(None, "--lisa-layers", metavar="N",
                                              help="LISA with N active layers (γ)."),
    no_lisa: bool = typer.Option(False, "--no-lisa", help="Full fine-tuning.", metavar=""),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", metavar="N",
                                             help="Sequences per micro-batch."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", metavar="N", help="Tokens per sequence."),
    gradient_checkpointing: Optional[bool] = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Recompute layer activations in backward (or not)."),
    attention: Optional[str] = typer.Option(None, "--attention", metavar="KIND",
                                            help="flash_attention_2, sdpa or eager."),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar="DTYPE",
                                        help="bfloat16 or float32."),
    in_backward: Optional[bool] = typer.Option(
        None, "--in-backward/--no-in-backward",
        help="Step each parameter inside backward, freeing its gradient at once (or not)."),
    cpu_offload: Optional[bool] = typer.Option(
        None, "--cpu-offload/--no-cpu-offload",
        help="Moments, accumulated gradients and the step in host memory (or not)."),
    host_ram: Optional[str] = typer.Option(
        None, "--host-ram", metavar="SIZE", help="The machine's RAM, e.g. 64GiB, for what "
        "stays in host memory: --cpu-offload's, offloaded layer inputs' (default: this machine's)."),
    budget: Optional[str] = typer.Option(None, "--budget", metavar="SIZE", help="Memory budget with a unit: "
                                         "24GB (10^9 bytes) or 24GiB (2^30). Default 24GiB."),
    gpu: Optional[str] = typer.Option(None, "--gpu", metavar="NAME", help="Budget of a card: rtx-3090, "
                                      "rtx-4090, a6000, l4, a100-40gb, a100-80gb, h100-80gb, h200."),
    device: Optional[str] = typer.Option(None, "--device", metavar="DEVICE",
                                         help="cuda or cpu (default: the recipe's, else cuda)."),
    fsdp: Optional[bool] = typer.Option(None, "--fsdp/--no-fsdp",
                                        help="Weights, gradients and moments sharded over ranks (or not)."),
    ranks: Optional[int] = typer.Option(None, "--ranks", metavar="N",
                                        help="One rank's figures for N processes under FSDP."),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help=SET_HELP),
    json_out: bool = typer.Option(False, "--json", help="Print the estimate as JSON.", metavar=""),
    explain: bool = typer.Option(False, "--explain", help="Explain paged optimizer memory.", metavar=""),
) -> int:
    """Will it fit, where does the memory go, what to change."""
    from lisaft.memory.command import EstimateFlags, estimate_memory_command

    return estimate_memory_command(EstimateFlags(
        recipe=recipe, model=model, optimizer=optimizer, lisa_layers=lisa_layers,
        no_lisa=no_lisa, batch_size=batch_size, seq_len=seq_len,
        gradient_checkpointing=gradient_checkpointing, attention=attention, dtype=dtype,
        in_backward=in_backward, cpu_offload=cpu_offload, host_ram=host_ram,
        budget=budget, gpu=gpu, device=device, overrides=tuple(set_ or ()),
        json_out=json_out, explain=explain, fsdp=fsdp, ranks=ranks,
    ))


@app.command()
@_exits
def plot(
    runs: List[Path] = typer.Argument(..., metavar="RUN...", help="Run directories (several are overlaid)."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="FILE",
                                       help="PNG to write. Default: RUN/plot.png, or ./plot.png for several runs."),
) -> int:
    """Plot runs: loss, eval, lr, grad norm, speed, memory, LISA layers."""
    from lisaft.metrics.plot import plot_command

    return plot_command(runs, out)


@app.command()
@_exits
def generate(
    path: Path = typer.Argument(..., metavar="RUN_OR_MODEL_DIR",
                                help="A run (uses RUN/final and RUN/recipe.yaml), one of its checkpoints "
                                     "(RUN/checkpoints/step-N) or a model folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", metavar="TEXT",
                                         help="The instruction, user message or text to continue."),
    input_text: Optional[str] = typer.Option(None, "--input", metavar="TEXT",
                                             help="The `input` field of an instruction prompt."),
    input_file: Optional[Path] = typer.Option(
        None, "--input-file", metavar="FILE",
        help="Rows as the run's data.train takes them (jsonl, ...; its data.columns and data.roles "
             "apply); answers given are compared."),
    limit: Optional[int] = typer.Option(None, "--limit", metavar="N", help="Only the first N rows of --input-file."),
    fmt: Optional[str] = typer.Option(None, "--format", metavar="FORMAT",
                                      help=f"{', '.join(FORMAT_NAMES)}. Default: the run's data.format."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", metavar="N", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, "--temperature", metavar="T", help="0: greedy; above 0: sample."),
    top_p: float = typer.Option(1.0, "--top-p", metavar="P", help="Nucleus sampling mass (with --temperature)."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed for sampling."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per prompt.", metavar=""),
) -> int:
    """Try a model with the prompt format its run trained on."""
    from lisaft.generate.command import generate_command

    return generate_command(path, prompt=prompt, input_text=input_text, input_file=input_file, fmt=fmt,
                            limit=limit, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, seed=seed, json_out=json_out)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # A user reads "warning: ..." once; the file and line of the warn() call mean nothing to them.
    print(f"warning: {message}", file=sys.stderr if file is None else file, flush=True)


def main() -> None:
    import warnings

    warnings.showwarning = _one_line_warning
    from lisaft.env import configure_process

    configure_process()  # before torch loads OpenMP and initialises CUDA
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except SystemExit as e:
        from lisaft.distributed import dist

        if dist.launched() and isinstance(e.code, int | None):
            dist.leave_process(e.code or 0)
        raise


if __name__ == "__main__":
    main()
