#!/usr/bin/env bash
# Gathers, on a machine with network, every wheel the GPU suite needs beyond torch, transformers
# and nvidia-ml-py into two folders, one carry each (under 64 MiB with the tree; git-ignored,
# never committed), which benchmarks/gpu_run.sh installs there without a network:
#   wheels/base/  lisaft's dependencies and theirs: bitsandbytes, pydantic and what it needs (the
#                 lent machine lacks these), typer with annotated-doc, rich, peft, accelerate, ...
#   wheels/jit/   numba with its own llvmlite (numba imports only with the llvmlite it was built
#                 for), for a machine without them: the lent one has both. llvmlite's wheel is
#                 re-packed with LZMA (57 MiB to 39 MiB; pip reads it like any wheel), so the
#                 folder and the tree fit one carry.
# For PY (default 3.12, the lent machine's) on PLATFORM (default manylinux2014_x86_64 and newer).
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${WHEELS:-wheels}"
py="${PY:-3.12}"
platform="${PLATFORM:-manylinux2014_x86_64}"
base=(
    bitsandbytes pydantic pydantic-core annotated-types typing-inspection typing-extensions
    typer annotated-doc click shellingham rich markdown-it-py mdurl pygments pyyaml xxhash safetensors
    peft accelerate psutil
    # The gpu-tests step runs pytest, which a bare lent machine lacks; the tests' markers need
    # pytest-timeout (--strict-markers).
    pytest pluggy iniconfig packaging pytest-timeout
)
jit=(numba llvmlite)
# The versions this tree's tests ran with: run it in that environment (the project's venv). A
# package it lacks is refused, not fetched at whatever version the index has now.
pins() {
    python3 - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    print(f"error: not installed here, so no version to pin: {' '.join(missing)} (run this in the "
          "project's venv, where the tests ran)", file=sys.stderr)
    sys.exit(2)
PY
}
download() {  # FOLDER PACKAGES...
    local folder=$1; shift
    mkdir -p "$folder"
    local pinned
    pinned=$(pins "$@") || exit 2
    mapfile -t pinned <<< "$pinned"
    python3 -m pip download --quiet --only-binary=:all: --no-deps --dest "$folder" \
        --python-version "$py" --platform "$platform" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform any "${pinned[@]}"
}
download "$dest/base" "${base[@]}"
download "$dest/jit" "${jit[@]}"
for w in "$dest"/jit/llvmlite-*.whl; do
    python3 - "$w" <<'PY'
import os, sys, zipfile
path = sys.argv[1]
with zipfile.ZipFile(path) as z:
    if all(i.compress_type == zipfile.ZIP_LZMA for i in z.infolist()):
        sys.exit(0)
    with zipfile.ZipFile(path + ".lzma", "w", zipfile.ZIP_LZMA) as out:
        for info in z.infolist():
            out.writestr(info, z.read(info), compress_type=zipfile.ZIP_LZMA)
os.replace(path + ".lzma", path)
PY
done
# lisaft itself runs from the tree (gpu_run.sh puts it on PYTHONPATH): no wheel.
find "$dest" -name '*.whl' | sort | sed 's/^/  /'
du -sh "$dest"/base "$dest"/jit
