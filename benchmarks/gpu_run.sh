#!/usr/bin/env bash
# The GPU suite in one command, on a bare CUDA machine (torch, transformers, nvidia-ml-py; no
# network): installs the wheels benchmarks/gpu_wheels.sh gathered into $WHEELS (default wheels/,
# carried with the tree), checks that everything imports and that NVML answers, then runs the
# plan, most valuable first, each measurement time-boxed and its JSON written when it ends, into
# $OUT (default benchmarks/results/gpu). The plan fits 9 minutes on one H200:
#   1 lisa-8b        recipes/llama3.1-8b-lisa-24gb.yaml: NVML peak against the estimate  (80 s)
#   2 offload-full   recipes/llama3.1-8b-full-24gb.yaml, optimizer on the CPU            (150 s)
#   3 paged-full     full fine-tuning, paged AdamW 8-bit stepped in backward             (60 s)
#   4 equality       CUDA equality checks (benchmarks/gpu_equality.py)                   (60 s)
#   5 packing        packing with FlashAttention varlen where flash-attn is installed    (80 s)
#   6 fsdp           training.fsdp on one rank against the same run without it           (100 s)
#   7 apollo-8b      recipes/llama3.1-8b-apollo-24gb.yaml: NVML peak against the estimate (60 s),
#                    only where the plan so far left it 60 s of its 9 minutes (always in --dry-run)
# Every 8B run is capped at 24 GiB of allocations, and flags an NVML peak over 24 GiB (the
# context, kernel images and paged state sit outside the cap): nvml_over_24gib in its JSON.
#   bash benchmarks/gpu_run.sh                  # on the GPU machine
#   bash benchmarks/gpu_run.sh --dry-run        # the same plan on CPU at tiny size (CI)
#   bash benchmarks/gpu_run.sh --install-only   # install the wheels carried now, measure nothing
# The wheels go into $SITE (default $TMPDIR/lisaft-site), which later calls reuse: wheels carried
# in turns (gpu_wheels.sh puts each one over 40 MB in a folder of its own) add up there.
set -uo pipefail
cd "$(dirname "$0")/.."
dry="" install_only=""
[[ "${1:-}" == "--dry-run" ]] && dry=1
[[ "${1:-}" == "--install-only" ]] && install_only=1
out="${OUT:-benchmarks/results/gpu}"
wheels="${WHEELS:-wheels}"
site="${SITE:-${TMPDIR:-/tmp}/lisaft-site}"
mkdir -p "$out"
py=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
mapfile -t carried < <(compgen -G "$wheels/any/*.whl"; compgen -G "$wheels/any-*/*.whl"
                       compgen -G "$wheels/py$py/*.whl"; compgen -G "$wheels/py$py-*/*.whl")
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
python3 - "$dry" <<'PY' 2>&1 | tee "$out/preflight.log"
import importlib, sys
dry = bool(sys.argv[1])
missing = []
for name in ("torch", "transformers", "bitsandbytes", "pydantic", "yaml", "rich", "typer", "safetensors",
             "xxhash", "numpy", "numba", "llvmlite", "peft", "accelerate", "psutil", "lisaft.train",
             "lisaft.memory.command", "lisaft.optim.host_kernel"):
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
[[ ${PIPESTATUS[0]} -eq 0 ]] || exit 2

suite=(python3 -m benchmarks.gpu_8b_24gb)
[[ -n "$dry" ]] && suite+=(--tiny)
failed=0
step() {  # NAME SECONDS COMMAND...: one measurement, time-boxed, its log beside its JSON
    local name=$1 secs=$2; shift 2
    echo "== $name (at most ${secs} s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$secs" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    tail -n 3 "$out/$name.log"
    echo "$name: $((SECONDS - t0)) s"
    [[ $rc -eq 0 ]] || { echo "$name: exit $rc"; failed=1; }
}
step lisa-8b 80 "${suite[@]}" --configs headroom --budget-s 70 --out "$out/lisa-8b.json"
step offload-full 150 "${suite[@]}" --configs offload-full-ga8 --budget-s 140 --out "$out/offload-full.json"
step paged-full 60 "${suite[@]}" --configs full-in-backward --budget-s 50 --out "$out/paged-full.json"
step equality 60 python3 -m benchmarks.gpu_equality ${dry:+--dry-run} --out "$out/equality.json"
if [[ -n "$dry" ]]; then
    step packing 80 python3 -m benchmarks.packing_bench --quick --device cpu --out "$out/packing"
else
    attention=$(python3 -c "import importlib.util as u; print('flash_attention_2' if u.find_spec('flash_attn') else 'sdpa')")
    step packing 80 python3 -m benchmarks.packing_bench --gpu-size --device cuda --attention "$attention" --out "$out/packing"
fi
step fsdp 100 "${suite[@]}" --configs fsdp-ref,fsdp-1rank --budget-s 90 --out "$out/fsdp.json"
if [[ -n "$dry" ]] || (( SECONDS + 60 <= 540 )); then
    step apollo-8b 60 "${suite[@]}" --configs apollo-8b --budget-s 50 --out "$out/apollo-8b.json"
else
    echo "== apollo-8b skipped: the plan has used ${SECONDS} s of its 540"
fi
echo "results in $out"
exit $failed
