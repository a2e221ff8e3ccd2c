"""What a person sees: the progress display on an 80-column terminal, and no other library's
noise on a CPU run with an 8-bit optimizer."""

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _run_on_terminal(args, columns=80, timeout=240):
    """Run with stdout and stderr on a pseudo-terminal of `columns` columns; return what it showed."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "lisaft", *args], stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env=_env(COLUMNS=str(columns), TERM="xterm"))
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], timeout)
        if not ready:
            proc.kill()
            raise TimeoutError("no output")
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_progress_fits_80_columns_and_keeps_step_lines(tiny_run):
    recipe = tiny_run(training={"max_steps": 6, "log_every": 2, "eval_every": 3})
    shown = _run_on_terminal(["train", str(recipe)])
    lines = [ANSI.sub("", piece).rstrip() for piece in re.split(r"\r\n|\r|\n", shown)]
    step_lines = [l for l in lines if re.match(r"step \d+/6  loss \d", l)]
    assert [l.split()[1] for l in step_lines] == ["2/6", "4/6", "6/6"], shown
    assert all(len(l) <= 80 for l in step_lines), step_lines
    evals = [l for l in lines if l.startswith("eval step")]
    assert [l.split()[2] for l in evals] == ["0", "3", "6"], shown
    assert not any("eval" in l for l in step_lines)  # the last eval is not repeated on step lines


@pytest.mark.slow
def test_cpu_run_with_8bit_optimizer_prints_no_third_party_noise(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    # From a model folder, as users run: that is when transformers shows its loading bar.
    cfg = LlamaConfig.from_pretrained(tiny_run.dir / "model")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tiny_run.dir / "weights")
    AutoTokenizer.from_pretrained(REPO / "recipes" / "quickstart" / "tokenizer").save_pretrained(
        tiny_run.dir / "weights")
    recipe = tiny_run(model={"name_or_path": "weights", "config": None, "tokenizer": None},
                      optimizer={"name": "adamw_8bit"}, training={"max_steps": 2})
    proc = subprocess.run([sys.executable, "-m", "lisaft", "train", str(recipe)], capture_output=True,
                          text=True, env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout
    assert proc.stderr == "", proc.stderr
    for noise in ("gemm_4bit", "pip install kernels", "Loading weights", "bitsandbytes", "%|"):
        assert noise not in proc.stdout, proc.stdout
