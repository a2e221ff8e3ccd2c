"""What packing buys on data shaped like real chat sets. benchmarks/packing_bench.py.

Documents of seeded log-normal lengths (median about 200 tokens, a tail cut at max_seq_len), drawn
from a fixed random Markov chain (BOS, tokens, EOS) so there is something to learn, are trained
for one epoch by the same small Llama from the same initial weights, in the same number of
optimizer steps with the same token budget per step, five ways:

    batch1       one example per micro-batch: no padding, short matmuls
    padded8      8 examples per micro-batch, right-padded to the longest
    concat       the old data.packing (kept here only): examples concatenated and cut into rows of
                 exactly max_seq_len, positions running on, attention across documents, tail dropped
    packed       lisaft's data.packing: best-fit rows of whole examples, per-document positions,
                 each document attending only to itself
    padding_free 8 examples flattened into one row with per-document positions; on CUDA with
                 flash_attention_2 the varlen kernel skips the masked blocks, on CPU sdpa computes
                 the whole block-diagonal row

Per contender and seed: real tokens/s (positions holding a document token, per second of
training; also per CPU-second of the process, steadier on a shared machine), the share of
computed positions that are real, a step's peak memory above what was resident before it
(activations, gradients, temporaries; CUDA: allocated bytes, CPU: resident set) and the eval
loss after the epoch (held-out documents, each alone), i.e. at an equal number of real
training tokens. The contenders advance
in lockstep, one optimizer step each in turn, so that other load on the machine falls on all
of them alike.

    nice -n 15 python -m benchmarks.packing_bench            # full: 3 seeds, CPU ~15 min
    python -m benchmarks.packing_bench --quick               # a tiny model and set: ~10 s
    python -m benchmarks.packing_bench --gpu-size --attention flash_attention_2   # GPU suite

Writes packing.json and packing.md into --out (default benchmarks/results/packing, or
benchmarks/results/packing-quick with --quick).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lisaft.data.collate import IGNORE_INDEX, collate, real_positions, to_device
from lisaft.data.packing import pack_examples
from lisaft.model.attention import varlen_attention
from lisaft.model.loss import eval_sums, token_loss_sum

REPO = Path(__file__).resolve().parents[1]

CONTENDERS = ("batch1", "padded8", "concat", "packed", "padding_free")
# Sized for a shared 2-core CPU: about a minute per contender and seed.
FULL = dict(layers=2, hidden=128, intermediate=344, heads=4, vocab=256, max_seq_len=1024,
            median=200, sigma=0.8, n_train=64, n_eval=24, steps=8, rows_per_batch=1, lr=3e-3,
            seeds=(0, 1, 2))
QUICK = dict(layers=1, hidden=32, intermediate=64, heads=4, vocab=64, max_seq_len=128,
             median=24, sigma=0.8, n_train=64, n_eval=8, steps=2, rows_per_batch=2, lr=2e-3,
             seeds=(0,))
# For the GPU suite (benchmarks/gpu_plan.py, a 60 s box): a 1B-class Llama shape, full 2,048-token
# rows, one seed. The documents draw on 1,024 of its 32,000 token ids (data_vocab): the chain's
# table is then 8 MB, where the whole vocabulary's would be 8.2 GB of float64.
GPU = dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=32000, data_vocab=1024,
           max_seq_len=2048, median=200, sigma=0.8, n_train=384, n_eval=64, steps=8, rows_per_batch=4, lr=3e-4,
           seeds=(0,))
BOS, EOS, PAD = 1, 2, 0


# --- data ---------------------------------------------------------------------------------------


def _documents(cfg: dict, n: int, rng: np.random.Generator, chain: np.ndarray) -> list[dict]:
    """Markov-chain documents of log-normal length (BOS ... EOS), loss on every token."""
    lengths = np.clip(rng.lognormal(np.log(cfg["median"]), cfg["sigma"], n).astype(int), 8, cfg["max_seq_len"])
    docs = []
    for length in lengths.tolist():
        ids = [BOS, int(rng.integers(3, cfg.get("data_vocab", cfg["vocab"])))]
        draws = rng.random(length - 3)
        for u in draws:
            ids.append(int(np.searchsorted(chain[ids[-1]], u)) + 3)
        ids.append(EOS)
        docs.append({"input_ids": ids, "labels": list(ids)})
    return docs


def make_data(cfg: dict, seed: int) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng([seed, 0x70616B])
    vocab = cfg.get("data_vocab", cfg["vocab"])
    v = vocab - 3
    # Each token has a few likely successors: a chain a small model can learn in one epoch.
    weights = rng.dirichlet(np.full(v, 0.05), size=vocab)
    chain = np.minimum(np.cumsum(weights, axis=1), 1.0 - 1e-12)
    return _documents(cfg, cfg["n_train"], rng, chain), _documents(cfg, cfg["n_eval"], rng, chain)


# --- the contenders' micro-batches (lists of examples or rows) ------------------------------------


def _concatenated(examples: list[dict], max_seq_len: int) -> list[dict]:
    """The old data.packing, for comparison only: one stream cut into full rows, tail dropped."""
    ids = [t for ex in examples for t in ex["input_ids"]]
    labels = [t for ex in examples for t in ex["labels"]]
    return [{"input_ids": ids[k:k + max_seq_len], "labels": labels[k:k + max_seq_len]}
            for k in range(0, len(ids) - max_seq_len + 1, max_seq_len)]


def micro_batches(name: str, examples: list[dict], cfg: dict, seed: int) -> tuple[list[list[dict]], dict]:
    order = np.random.default_rng([seed, 1]).permutation(len(examples))
    shuffled = [examples[i] for i in order]
    rows_per = cfg["rows_per_batch"]
    info: dict = {}
    if name == "batch1":
        return [[ex] for ex in shuffled], info
    if name in ("padded8", "padding_free"):
        return [shuffled[i:i + 8] for i in range(0, len(shuffled), 8)], info
    if name == "concat":
        rows = _concatenated(shuffled, cfg["max_seq_len"])
        info["dropped_tokens"] = real_positions(examples) - real_positions(rows)
    else:
        packing = pack_examples(examples, cfg["max_seq_len"], seed)
        info["summary"], info["fill"] = packing.summary(), packing.fill
        rows = [packing.rows[i] for i in np.random.default_rng([seed, 2]).permutation(len(packing.rows))]
    return [rows[i:i + rows_per] for i in range(0, len(rows), rows_per)], info


def _steps(micro: list[list[dict]], n_steps: int) -> list[list[list[dict]]]:
    """Micro-batches in n_steps optimizer steps, none empty, of about equal real tokens."""
    if len(micro) < n_steps:
        raise SystemExit(f"{len(micro)} micro-batches cannot make {n_steps} steps: add examples")
    cum = np.cumsum([real_positions(m) for m in micro])
    cuts, prev = [], 0
    for k in range(1, n_steps):
        i = int(np.searchsorted(cum, k * cum[-1] / n_steps)) + 1
        prev = min(max(i, prev + 1), len(micro) - (n_steps - k))
        cuts.append(prev)
    bounds = [0, *cuts, len(micro)]
    return [micro[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# --- measuring ------------------------------------------------------------------------------------


def _model(cfg: dict, seed: int, device: torch.device, attention: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg.get("kv_heads", cfg["heads"]),
                         max_position_embeddings=cfg["max_seq_len"],
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                         use_cache=False)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention).to(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _memory(device: torch.device, peak: bool) -> int:
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated)(device)
    field = "VmHWM:" if peak else "VmRSS:"
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


@torch.no_grad()
def eval_loss(model, evals: list[dict], device: torch.device) -> float:
    model.eval()
    loss = tokens = 0.0
    for i in range(0, len(evals), 8):
        batch = to_device(collate(evals[i:i + 8], PAD), device)
        s, n, _ = eval_sums(model, batch)
        loss, tokens = loss + s, tokens + n
    model.train()
    return loss / tokens


class Contender:
    """One way of batching, with its own model (same initial weights) and optimizer."""

    def __init__(self, name: str, train: list[dict], cfg: dict, seed: int, device: torch.device,
                 attention: str):
        self.name, self.device = name, device
        micro, self.info = micro_batches(name, train, cfg, seed)
        self.steps = _steps(micro, cfg["steps"])
        self.model = _model(cfg, seed, device, attention).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=0.0)
        # On the varlen kernels packed rows are flattened as lisaft's training step does; padded8
        # stays padded, to show what padding costs.
        self.flatten = name == "padding_free" or (name == "packed" and varlen_attention(self.model))
        self.real = self.computed = 0
        self.seconds = self.cpu_seconds = 0.0
        self.peak = 0

    def step(self, k: int) -> None:
        _reset_peak(self.device)
        before = _memory(self.device, peak=False)
        t0, cpu0 = time.perf_counter(), time.process_time()
        batches = [collate(m, PAD, flatten=self.flatten) for m in self.steps[k]]
        n_loss = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
        for m, b in zip(self.steps[k], batches):
            loss = token_loss_sum(self.model, to_device(b, self.device))
            (loss / n_loss).backward()
            self.real += real_positions(m)
            self.computed += b["input_ids"].numel()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        self.cpu_seconds += time.process_time() - cpu0
        self.peak = max(self.peak, _memory(self.device, peak=True) - before)

    def result(self, evals: list[dict]) -> dict:
        return {"steps": len(self.steps), "real_tokens": self.real, "computed_positions": self.computed,
                "real_share": self.real / self.computed, "real_tokens_per_s": self.real / self.seconds,
                "real_tokens_per_cpu_s": self.real / self.cpu_seconds, "seconds": self.seconds,
                "step_peak_bytes": self.peak, "eval_loss": eval_loss(self.model, evals, self.device),
                **self.info}


def train_all(train: list[dict], evals: list[dict], cfg: dict, seed: int, device: torch.device,
              attention: str, progress=None) -> dict[str, dict]:
    """The contenders advance in lockstep, one optimizer step each in turn (the order rotating),
    so a load that comes and goes on a shared machine falls on all of them alike. `progress`
    gets each contender's figures so far after every step."""
    contenders = [Contender(name, train, cfg, seed, device, attention) for name in CONTENDERS]
    for k in range(cfg["steps"]):
        for c in contenders[k % len(contenders):] + contenders[:k % len(contenders)]:
            c.step(k)
        if progress is not None:
            progress({"seed": seed, "steps_done": k + 1, "contenders": {
                c.name: {"real_tokens": c.real, "seconds": c.seconds, "step_peak_bytes": c.peak} for c in contenders}})
    return {c.name: c.result(evals) for c in contenders}


# --- the report -----------------------------------------------------------------------------------


def summarise(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for name, per_seed in runs.items():
        row = {}
        for key in ("real_tokens_per_s", "real_tokens_per_cpu_s", "real_share", "step_peak_bytes", "eval_loss"):
            values = [r[key] for r in per_seed]
            row[key] = statistics.fmean(values)
            row[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
        out[name] = row
    pad8, packed = out["padded8"], out["packed"]
    noise = max(pad8["eval_loss_sd"], packed["eval_loss_sd"], out["batch1"]["eval_loss_sd"])
    unpacked_best = min(out["batch1"]["eval_loss"], pad8["eval_loss"])
    out["targets"] = {
        "packed_fill": min(r["fill"] for r in runs["packed"]),
        "packed_fill_ok": min(r["fill"] for r in runs["packed"]) >= 0.95,
        "speedup_vs_padded8": packed["real_tokens_per_s"] / pad8["real_tokens_per_s"],
        "speedup_vs_padded8_cpu_time": packed["real_tokens_per_cpu_s"] / pad8["real_tokens_per_cpu_s"],
        "speedup_ok": packed["real_tokens_per_s"] >= 1.5 * pad8["real_tokens_per_s"],
        "eval_loss_vs_unpacked": packed["eval_loss"] - unpacked_best,
        "eval_loss_seed_sd": noise,
        "eval_loss_ok": packed["eval_loss"] <= unpacked_best + 2 * noise + 1e-3,
    }
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"# packing_bench ({result['mode']}, {result['device']}, {result['attention']})", "",
             f"Command: `{result['command']}`", "",
             "| contender | real tokens/s | per CPU-second | real share | step peak MiB | eval loss |",
             "|---|---|---|---|---|---|"]
    for name in CONTENDERS:
        r = s[name]
        lines.append(f"| {name} | {r['real_tokens_per_s']:,.0f} ± {r['real_tokens_per_s_sd']:,.0f} "
                     f"| {r['real_tokens_per_cpu_s']:,.0f} | {r['real_share']:.1%} "
                     f"| {r['step_peak_bytes'] / 2**20:,.0f} "
                     f"| {r['eval_loss']:.4f} ± {r['eval_loss_sd']:.4f} |")
    t = s["targets"]
    fill_ok = "met" if t["packed_fill_ok"] else "missed"
    lines += ["", f"- packing fill {t['packed_fill']:.1%} (target >= 95%: {fill_ok})",
              f"- packed / padded8 real tokens/s: {t['speedup_vs_padded8']:.2f}x wall-clock "
              f"(target >= 1.5x: {'met' if t['speedup_ok'] else 'missed'}), "
              f"{t['speedup_vs_padded8_cpu_time']:.2f}x per CPU-second",
              f"- packed eval loss minus the best unpacked: {t['eval_loss_vs_unpacked']:+.4f} "
              f"(seed sd {t['eval_loss_seed_sd']:.4f}; no worse: {'met' if t['eval_loss_ok'] else 'missed'})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu-size", action="store_true", help="the GPU suite's 1B-class model and data")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--attention", default="sdpa", help="sdpa | eager | flash_attention_2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else GPU if args.gpu_size else FULL
    mode = "quick" if args.quick else "gpu" if args.gpu_size else "full"
    out = args.out or REPO / "benchmarks" / "results" / ("packing" if mode == "full" else f"packing-{mode}")
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    out.mkdir(parents=True, exist_ok=True)

    def progress(now: dict) -> None:  # a run cut at its time box keeps what it measured
        (out / "packing.json").write_text(json.dumps({"benchmark": "packing_bench", "mode": mode, "complete": False,
                                                      "runs": runs, "in_progress": now}, indent=1))

    for seed in cfg["seeds"]:
        train, evals = make_data(cfg, seed)
        for name, r in train_all(train, evals, cfg, seed, device, args.attention, progress).items():
            runs[name].append({"seed": seed, **r})
            print(f"seed {seed} {name:13s} {r['real_tokens_per_s']:9,.0f} real tok/s  "
                  f"real {r['real_share']:.1%}  eval {r['eval_loss']:.4f}", flush=True)
    result = {
        "benchmark": "packing_bench", "mode": mode,
        "command": "python -m benchmarks.packing_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(), "attention": args.attention, "torch": torch.__version__,
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()},
        "runs": runs, "summary": summarise(runs), "complete": True,
    }
    (out / "packing.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "packing.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
