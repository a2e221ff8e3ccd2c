#!/usr/bin/env bash
# The GPU suite in one command, for a CUDA machine with torch, transformers and nvidia-ml-py but
# no network: installs the wheels carried in $WHEELS (default wheels/, see docs/memory.md for
# which), then runs benchmarks/gpu_8b_24gb.py within $BUDGET_S seconds (default 420), writing
# gpu_8b_24gb.json, gpu_8b_24gb.md and the log into $OUT (default benchmarks/results).
# Extra arguments go to the suite, e.g. `benchmarks/gpu_run.sh --tiny` on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
wheels="${WHEELS:-wheels}"
mkdir -p "$out"
if compgen -G "$wheels/*.whl" > /dev/null; then
    # Into a folder of its own, put first on the path: the machine's packages stay untouched.
    site="${TMPDIR:-/tmp}/lisaft-site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import bitsandbytes, pydantic, yaml, rich" || {
    echo "error: bitsandbytes, pydantic, pyyaml and rich must be importable: carry their wheels in $wheels/" >&2
    exit 2
}
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
python3 -m benchmarks.gpu_8b_24gb --budget-s "${BUDGET_S:-420}" --out "$out/gpu_8b_24gb.json" "$@" 2>&1 \
    | tee "$out/gpu_8b_24gb.log"
# Packing (docs/data.md): the CPU benchmark's contenders at a 1B-class size, on the varlen kernel
# where flash-attn is installed. Not part of --tiny (the CPU test runs packing_bench --quick).
if [[ " $* " != *" --tiny "* ]]; then
    attention=$(python3 -c "import importlib.util as u; print('flash_attention_2' if u.find_spec('flash_attn') else 'sdpa')")
    python3 -m benchmarks.packing_bench --gpu-size --device cuda --attention "$attention" \
        --out "$out/packing-gpu" 2>&1 | tee "$out/packing_bench.log"
fi
