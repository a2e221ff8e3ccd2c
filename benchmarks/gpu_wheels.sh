#!/usr/bin/env bash
# Gathers, on a machine with network, every wheel the GPU suite needs beyond what a bare CUDA
# machine has (torch, transformers, nvidia-ml-py) into wheels/ (git-ignored, never committed),
# which travels with the tree; benchmarks/gpu_run.sh installs them there without a network.
# For each of PY_VERSIONS (default "3.12 3.11": the lent H200 runs 3.12), on PLATFORM (default
# manylinux2014_x86_64): wheels that fit any python go to wheels/any/, the others to
# wheels/py3.12/ and so on; gpu_run.sh installs any/ and its own python's folders. flash-attn has no binary wheel on the index: its varlen
# check runs where the machine has it, and is reported skipped otherwise.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${WHEELS:-wheels}"
platform="${PLATFORM:-manylinux2014_x86_64}"
mkdir -p "$dest/any"
# lisaft's own dependencies (pyproject.toml) and theirs, minus what the machine brings, with the
# host-step extra (numba, llvmlite: the CPU step of the offload run) and the lora extra (peft and
# what it needs beyond transformers). Pure Python ones come as py3-none-any wheels; the others
# for $py on $platform.
packages=(
    bitsandbytes pydantic pydantic-core annotated-types typing-inspection typing-extensions
    typer click shellingham rich markdown-it-py mdurl pygments pyyaml xxhash safetensors
    numba llvmlite peft accelerate psutil
)
# The versions this tree's tests ran with, where this python has them installed.
mapfile -t pinned < <(python3 - "${packages[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
for py in ${PY_VERSIONS:-3.12 3.11}; do
    mkdir -p "$dest/py$py"
    python3 -m pip download --quiet --only-binary=:all: --no-deps --dest "$dest/py$py" \
        --python-version "$py" --platform "$platform" --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform any "${pinned[@]}"
    for w in "$dest/py$py"/*-none-*.whl; do mv -f "$w" "$dest/any/"; done  # one copy of each pure wheel
done
# A wheel over 40 MB (llvmlite, bitsandbytes) goes to a folder of its own, wheels/py3.12-llvmlite/
# or wheels/any-bitsandbytes/: a copy capped at 64 MiB carries the folders in turns, each installed
# by `gpu_run.sh --install-only`.
for w in $(find "$dest" -maxdepth 2 -name '*.whl' -size +40M); do
    folder=$(dirname "$w")
    [[ "$(basename "$folder")" == *-* ]] && continue  # already on its own
    own="$folder-$(basename "$w" | cut -d- -f1)"
    mkdir -p "$own"
    mv -f "$w" "$own/"
done
# lisaft itself runs from the tree (gpu_run.sh puts it on PYTHONPATH): no wheel.
find "$dest" -name '*.whl' | sort | sed 's/^/  /'
echo "$(find "$dest" -name '*.whl' | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest/"
