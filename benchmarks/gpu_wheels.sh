#!/usr/bin/env bash
# Gathers, on a machine with network, every wheel the GPU suite needs beyond what a bare CUDA
# machine has (torch, transformers, nvidia-ml-py) into wheels/ (git-ignored, never committed),
# which travels with the tree; benchmarks/gpu_run.sh installs them there without a network.
# PY_VERSION (default: this python3's, e.g. 3.11) and PLATFORM (default manylinux2014_x86_64)
# must match the GPU machine's python. flash-attn has no binary wheel on the index: its varlen
# check runs where the machine has it, and is reported skipped otherwise.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${WHEELS:-wheels}"
py="${PY_VERSION:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
platform="${PLATFORM:-manylinux2014_x86_64}"
mkdir -p "$dest"
# lisaft's own dependencies (pyproject.toml) and theirs, minus what the machine brings. Pure
# Python ones come as py3-none-any wheels; the others for $py on $platform.
packages=(
    bitsandbytes pydantic pydantic-core annotated-types typing-inspection typing-extensions
    typer click shellingham rich markdown-it-py mdurl pygments pyyaml xxhash safetensors
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
python3 -m pip download --quiet --only-binary=:all: --no-deps --dest "$dest" \
    --python-version "$py" --platform "$platform" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform any "${pinned[@]}"
# lisaft itself runs from the tree (gpu_run.sh puts it on PYTHONPATH): no wheel.
ls -1 "$dest" | sed 's/^/  /'
echo "$(ls -1 "$dest"/*.whl | wc -l) wheels in $dest/ for python $py on $platform"
