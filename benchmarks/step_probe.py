"""What one training step does, counted rather than timed: every aten operator of a step, with
its operands' shapes, strides, dtypes and layout, and per step the minor page faults, the bytes
freshly allocated by operators, and glibc's heap figures. For comparing lisaft's step with a
peer's (benchmarks/peer_sides.py) on a machine too loaded for timings to mean anything: the
counts do not depend on the load.

    python -m benchmarks.step_probe --side lisaft_full --side hf_full            # tiny shape
    python -m benchmarks.step_probe --real-model DIR --side lisaft_full --side hf_full
    python -m benchmarks.step_probe --diff A.json B.json                        # the op logs' difference

Each side runs in a fresh process, as peer_bench runs it; writes
benchmarks/results/peer/probe_<shape>_<side>.json (or --out-dir).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOGGED_STEP = 3  # the step whose operators are logged: after two whose state (moments) is settled
COUNTED_STEPS = 4  # steps after it whose page faults and heap are counted, without the log


def _glibc_heap() -> dict | None:
    """mallinfo2's arena (bytes held by brk heaps) and hblkhd (bytes in mmapped blocks)."""
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = Info
    info = fn()
    return {"arena": info.arena, "mmapped_blocks": info.hblks, "mmapped_bytes": info.hblkhd}


def _operand(t) -> str:
    """A tensor operand: dtype, shape, strides, and `nc` when not contiguous."""
    import torch

    if not isinstance(t, torch.Tensor):
        return repr(t) if isinstance(t, (int, float, bool)) or t is None else type(t).__name__
    layout = "" if t.layout == torch.strided else f" {t.layout}"
    if t.layout != torch.strided:
        return f"{t.dtype}{list(t.shape)}{layout}"
    nc = "" if t.is_contiguous() else " nc"
    return f"{str(t.dtype)[6:]}{list(t.shape)}/{list(t.stride())}{nc}"


def call_line(func, args: tuple, kwargs: dict) -> str:
    """One aten call as the log keeps it: the operator and each operand's layout."""
    import torch
    from torch.utils._pytree import tree_leaves

    operands = ", ".join(_operand(a) for a in tree_leaves(args))
    named = ", ".join(f"{k}={_operand(v)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    return f"{func}({operands}{'; ' + named if named else ''})"


def fresh_bytes(args: tuple, kwargs: dict, out) -> int:
    """Bytes of the outputs whose storage no input shares: what the call allocated."""
    import torch
    from torch.utils._pytree import tree_leaves

    def strided(x) -> list:
        return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor) and t.layout == torch.strided]

    given = {a.untyped_storage().data_ptr() for a in strided((args, kwargs))}
    return sum(o.untyped_storage().nbytes() for o in strided(out) if o.untyped_storage().data_ptr() not in given)


def op_log_mode():
    """A TorchDispatchMode that keeps one line per aten call, the bytes the calls allocated and
    the minor page faults while each ran (every thread's: the process's count)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.lines: list[str] = []
            self.fresh_bytes = 0
            self.faults: Counter = Counter()  # by the call's line

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            out = func(*args, **kwargs)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            self.fresh_bytes += fresh_bytes(args, kwargs, out)
            self.lines.append(call_line(func, args, kwargs))
            self.faults[self.lines[-1]] += faults
            return out

    return OpLog()


class Probe:
    """Stands in for peer_sides.Stamps: called at the end of every optimizer step."""

    def __init__(self) -> None:
        self.n = 0
        self.mode = None
        self.steps: list[dict] = []
        self.ops: list[str] = []
        self.fresh_bytes = 0
        self.op_faults: Counter = Counter()
        self.settings: dict = {}
        self._last = None

    def _counters(self) -> dict:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"minflt": ru.ru_minflt, "majflt": ru.ru_majflt, "heap": _glibc_heap()}

    def step_ended(self) -> None:
        self.n += 1
        now = self._counters()
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.ops, self.fresh_bytes, self.op_faults = self.mode.lines, self.mode.fresh_bytes, self.mode.faults
            self.mode = None
        if self._last is not None and self.n > LOGGED_STEP:
            self.steps.append({"step": self.n, "minflt": now["minflt"] - self._last["minflt"],
                               "majflt": now["majflt"] - self._last["majflt"], "heap_after": now["heap"],
                               "op_logged": self.n == LOGGED_STEP + 1})
        self._last = self._counters()
        if self.n == LOGGED_STEP:
            self.settings = _thread_settings()
            self.mode = op_log_mode()
            self.mode.__enter__()

    def result(self) -> dict:
        counts = Counter(self.ops)
        return {"settings": self.settings, "steps": self.steps, "fresh_bytes_logged_step": self.fresh_bytes,
                "minflt_by_op_logged_step": dict(self.op_faults.most_common(25)),
                "ops_logged_step": len(self.ops), "op_counts": dict(sorted(counts.items()))}


def _thread_settings() -> dict:
    import torch

    env = {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_", "KMP_", "GOMP_", "MALLOC_"))}
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(), "env": env,
            "grad_enabled": torch.is_grad_enabled(), "anomaly": torch.is_anomaly_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "mkldnn": torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def run_one(side: str, s: dict, work: Path) -> dict:
    import torch

    from benchmarks import peer_sides

    torch.set_num_threads(s["threads"])
    probe = Probe()
    s = {**s, "steps": LOGGED_STEP + COUNTED_STEPS + 1}
    if side.startswith("lisaft_"):
        peer_sides.lisaft_side(side, s, work, probe)  # type: ignore[arg-type]
    else:
        peer_sides.hf_side(side, s, work, probe)  # type: ignore[arg-type]
    return probe.result()


def diff(a: dict, b: dict, names: tuple[str, str]) -> list[str]:
    """The op lines one side runs more often than the other, most frequent first."""
    ca, cb = Counter(a["op_counts"]), Counter(b["op_counts"])
    out = []
    for label, only in ((f"more in {names[0]}", ca - cb), (f"more in {names[1]}", cb - ca)):
        out.append(f"== {label}: {sum(only.values())} calls")
        out += [f"{n:5d}  {line}" for line, n in only.most_common()]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", action="append", choices=["lisaft_full", "hf_full", "lisaft_lisa", "hf_lmflow"])
    ap.add_argument("--real-model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results" / "peer")
    ap.add_argument("--diff", nargs=2, type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.diff:
        a, b = (json.loads(p.read_text()) for p in args.diff)
        print("\n".join(diff(a, b, (args.diff[0].stem, args.diff[1].stem))))
        return 0
    from benchmarks.peer_bench import settings

    shape = "real" if args.real_model else "tiny"
    s = settings("full", shape, args.real_model, args.threads)
    if args.child:
        with tempfile.TemporaryDirectory(prefix="step_probe-") as work:
            print("RESULT " + json.dumps(run_one(args.child, s, Path(work))))
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for side in args.side or ["lisaft_full", "hf_full"]:
        cmd = [sys.executable, "-m", "benchmarks.step_probe", "--child", side, "--threads", str(args.threads)]
        cmd += ["--real-model", str(args.real_model)] if args.real_model else []
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"{side} failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
        out = json.loads(lines[-1][len("RESULT "):])
        path = args.out_dir / f"probe_{shape}_{side}.json"
        path.write_text(json.dumps(out, indent=1))
        faults = [st["minflt"] for st in out["steps"] if not st["op_logged"]]
        print(f"{side}: {out['ops_logged_step']} ops, {out['fresh_bytes_logged_step'] / 2**20:.0f} MiB fresh, "
              f"minor faults a step {faults}, {out['settings']}; wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
