"""The command line: parse, call one function, render. No training logic lives here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from lisaft.errors import LisaftError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fine-tune causal language models on one GPU: LISA, lean optimizers, exact resume.",
)


def _fail(message: str, code: int = 2) -> None:
    from rich.console import Console
    from rich.markup import escape

    # soft_wrap: the message stays one line however narrow the terminal, so it can be grepped.
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code)


@app.command()
def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a key: --set training.max_steps=100"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run already in output_dir."),
    force: bool = typer.Option(False, "--force", help="With --overwrite: go on although output_dir "
                               "holds files lisaft did not write (they are left alone)."),
) -> None:
    """Fine-tune as RECIPE says."""
    from lisaft.trainer import train as run_train

    try:
        code = run_train(recipe, overrides=set_ or [], overwrite=overwrite, force=force)
    except LisaftError as e:
        _fail(str(e), e.exit_code)
    raise typer.Exit(code)


@app.command()
def resume(
    run_dir: Path = typer.Argument(..., help="Run directory of a stopped or crashed run."),
    max_steps: Optional[int] = typer.Option(
        None, "--max-steps", help="Train to this step instead; the LR stays on its saved curve."),
    reschedule: bool = typer.Option(
        False, "--reschedule", help="Re-plan the LR decay from the current step to --max-steps."),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Change a key a resume may change: training.max_steps, training.log_every, "
        "training.eval_every, training.eval_batches, training.save_every, training.keep_last, "
        "training.device, model.gradient_checkpointing. Others alter the run and are refused."),
) -> None:
    """Continue RUN_DIR from its newest complete checkpoint, exactly."""
    from lisaft.trainer import resume as run_resume

    try:
        code = run_resume(run_dir, max_steps=max_steps, overrides=set_ or [], reschedule=reschedule)
    except LisaftError as e:
        _fail(str(e), e.exit_code)
    raise typer.Exit(code)


@app.command("estimate-memory")
def estimate_memory(
    recipe: Optional[Path] = typer.Argument(None, help="Recipe YAML to start from (flags override it)."),
    model: Optional[str] = typer.Option(None, "--model", help="Catalogue name (llama-3.1-8b), folder or hub id."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="adamw_32bit|adamw_8bit|paged_adamw_32bit|paged_adamw_8bit"),
    lisa_layers: Optional[int] = typer.Option(None, "--lisa-layers", help="LISA with this many active layers (γ)."),
    no_lisa: bool = typer.Option(False, "--no-lisa", help="Full fine-tuning."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len"),
    gradient_checkpointing: Optional[bool] = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing"),
    attention: Optional[str] = typer.Option(None, "--attention", help="flash_attention_2|sdpa|eager"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16|float16|float32"),
    in_backward: Optional[bool] = typer.Option(None, "--in-backward/--no-in-backward"),
    budget: Optional[str] = typer.Option(None, "--budget", help="Memory budget with a unit: 24GB (10^9 "
                                         "bytes) or 24GiB (2^30). Default 24GiB."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Budget of a card: rtx-3090, rtx-4090, a6000, "
                                      "l4, a100-40gb, a100-80gb, h100-80gb, h200."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda|cpu (default: the recipe's, else cuda)"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe key: --set data.max_seq_len=4096"),
    json_out: bool = typer.Option(False, "--json", help="Print the estimate as JSON."),
) -> None:
    """Will it fit, where does the memory go, what to change."""
    from lisaft.memory.command import estimate_memory_command

    try:
        code = estimate_memory_command(
            recipe=recipe, model=model, optimizer=optimizer, lisa_layers=lisa_layers,
            no_lisa=no_lisa, batch_size=batch_size, seq_len=seq_len,
            gradient_checkpointing=gradient_checkpointing, attention=attention, dtype=dtype,
            in_backward=in_backward, budget=budget, gpu=gpu, device=device, overrides=set_ or [],
            json_out=json_out,
        )
    except LisaftError as e:
        _fail(str(e))
    raise typer.Exit(code or 0)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    # A user reads "warning: ..." once; the file and line of the warn() call mean nothing to them.
    print(f"warning: {message}", file=sys.stderr if file is None else file, flush=True)


def main() -> None:
    import warnings

    warnings.showwarning = _one_line_warning
    from lisaft.allocator import configure_cuda_allocator

    configure_cuda_allocator()  # before anything initialises CUDA
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
