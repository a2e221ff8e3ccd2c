"""CI runs exactly the test command the README gives (ruff, mypy, pytest), so the two cannot drift."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    return next(line.strip() for line in lines if line.strip().startswith('pip install -e ".[dev]"'))


def test_ci_runs_the_readmes_test_command():
    command = readme_test_command()
    assert all(check in command for check in ("ruff check .", "mypy", "python -m pytest"))
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == command, "the last command of .ci/run must be the README's test command"


def test_the_set_up_block_installs_cpu_torch_before_lisaft():
    """Run as printed on a machine without a GPU, the set-up block installs no CUDA package: PyTorch's
    CPU build (or CI's pinned torch==2.13.0) comes before `pip install -e .`, which then keeps it."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up", 1)[1].split("\n\n")[1]
    commands = [line.strip() for line in block.splitlines()]
    lisaft = next(i for i, c in enumerate(commands) if c.startswith("pip install -e ."))
    torch = [c for c in commands[:lisaft] if c.startswith("pip install torch")]
    assert torch and ("/whl/cpu" in torch[0] or "torch==2.13.0" in torch[0]), block
