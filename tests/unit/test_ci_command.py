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
