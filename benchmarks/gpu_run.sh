#!/usr/bin/env bash
# The GPU suite in one command, on the lent CUDA machine (torch, transformers, nvidia-ml-py, numba,
# peft, accelerate; no network): installs the wheels benchmarks/gpu_wheels.sh gathered into
# $WHEELS (default wheels/, carried with the tree), checks that everything imports and that NVML
# answers, then runs benchmarks/gpu_plan.py's plan: lisa, dpo-grpo, offload, lora, apollo, long,
# gpu-tests, most valuable per device minute first, each under its own time box,
# the boxes summing to at most 540 s (`--plan` names on stderr what it leaves out). Everything comes back as two files in $OUT (default
# benchmarks/results/gpu): gpu-results.tar.gz (every step's JSON, markdown and log, rewritten
# after each step) and summary.json; the steps write elsewhere ($WORK, default a temporary folder).
#   bash benchmarks/gpu_run.sh --plan           # one JSON line per step: step, budget_s, expected_s
#   bash benchmarks/gpu_run.sh                  # on the GPU machine
#   bash benchmarks/gpu_run.sh --dry-run        # the same plan on CPU at tiny size (CI); fails if
#                                               # the GPU run would skip a named run for time
#   bash benchmarks/gpu_run.sh --install-only   # install the wheels carried now, measure nothing
# The wheels go into $SITE (default $TMPDIR/lisaft-site), which later calls reuse: a second
# carry (wheels/jit/, numba with its llvmlite) adds to the first there.
set -uo pipefail
cd "$(dirname "$0")/.."
dry="" install_only=""
[[ "${1:-}" == "--dry-run" ]] && dry=1
[[ "${1:-}" == "--install-only" ]] && install_only=1
if [[ "${1:-}" == "--plan" ]]; then
    exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -m benchmarks.gpu_plan plan
fi
out="${OUT:-benchmarks/results/gpu}"
wheels="${WHEELS:-wheels}"
site="${SITE:-${TMPDIR:-/tmp}/lisaft-site}"
work="${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/lisaft-gpu-XXXXXX")}"
mkdir -p "$out" "$work"
mapfile -t carried < <(compgen -G "$wheels/base/*.whl"; compgen -G "$wheels/jit/*.whl")
if [[ ${#carried[@]} -gt 0 ]]; then
    # Into a folder of its own, put first on the path: the machine's packages stay untouched.
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${carried[@]}" || { echo "error: installing the wheels in $wheels/ failed" >&2; exit 2; }
    touch "$site/.lisaft-wheels"
fi
if [[ -n "$install_only" ]]; then
    echo "installed ${#carried[@]} wheels into $site"
    exit 0
fi
[[ -f "$site/.lisaft-wheels" ]] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Preflight: nothing is measured unless everything imports and, on the GPU, NVML answers.
python3 - "$dry" <<'PY' 2>&1 | tee "$work/preflight.log"
import importlib, sys
dry = bool(sys.argv[1])
missing = []
for name in ("torch", "transformers", "bitsandbytes", "pydantic", "yaml", "rich", "typer", "annotated_doc",
             "safetensors", "xxhash", "numpy", "numba", "llvmlite", "peft", "accelerate", "psutil", "lisaft.train",
             "lisaft.cli", "lisaft.memory.command", "lisaft.optim.host_kernel", "pytest", "pytest_timeout"):
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__}: {e})")
if not dry:
    try:
        import pynvml
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            missing.append("NVML sees no GPU")
    except Exception as e:
        missing.append(f"NVML (nvidia-ml-py: {type(e).__name__}: {e})")
    import torch
    if not torch.cuda.is_available():
        missing.append("CUDA (torch.cuda.is_available() is False)")
if missing:
    print("error: preflight: " + "; ".join(missing) + " (gather wheels with benchmarks/gpu_wheels.sh)")
    sys.exit(2)
import torch
print("preflight ok: torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() and not dry else "cpu (dry run)")
PY
[[ ${PIPESTATUS[0]} -eq 0 ]] || { cp "$work/preflight.log" "$out/"; exit 2; }
exec python3 -m benchmarks.gpu_plan run ${dry:+--dry-run} --out "$out" --work "$work"
