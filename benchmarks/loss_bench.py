"""The chunked head + loss alone, forward and backward: gradients formed in the forward (the
summed token loss) against the recompute in backward (the per-position form, which the summed loss
used before issue 51), on SmolLM2-135M's shape by default. benchmarks/loss_bench.py.

    python -m benchmarks.loss_bench                       # 4 x 255 positions, 49,152 x 576 head, fp32
    python -m benchmarks.loss_bench --dtype bfloat16 --rounds 9
    python -m benchmarks.loss_bench --frozen-head         # the per-position form with a frozen head

`--frozen-head` times instead the per-position form where the head is frozen (LoRA), under one
random output gradient per position: the hidden states' gradient formed in the forward (what
head_nll runs there) against the recompute in backward that it ran before (_ChunkedHeadLoss).
The two run alternately, `rounds` times each after one warm-up; the best and the median count.
Both call lisaft/model/loss.py's own head_loss_sum and head_nll on the same hidden states and head.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", type=int, default=4 * 255)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frozen-head", action="store_true", help="the per-position form with a frozen head")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/loss_bench.json "
                    "(loss_bench_frozen_head.json with --frozen-head)")
    args = ap.parse_args(argv)
    out = args.out or REPO / "benchmarks" / "results" / f"loss_bench{'_frozen_head' if args.frozen_head else ''}.json"

    import torch

    from lisaft.model import loss

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(args.positions, args.hidden, generator=gen) * 0.5).to(dtype)
    weight = torch.nn.Parameter((torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(dtype))
    targets = torch.randint(0, args.vocab, (args.positions,), generator=gen)
    step = max(1, loss.LOSS_CHUNK_ELEMENTS // args.vocab)

    def fused() -> None:
        h = hidden.clone().requires_grad_()
        (loss.head_loss_sum(h, targets, weight) / args.positions).backward()

    def recompute() -> None:
        h = hidden.clone().requires_grad_()
        (loss.head_nll(h, targets, weight).sum() / args.positions).backward()

    frozen = weight.detach()
    grad_out = torch.randn(args.positions, generator=gen) / args.positions

    def frozen_forward() -> None:
        h = hidden.clone().requires_grad_()
        (loss.head_nll(h, targets, frozen) * grad_out).sum().backward()

    def frozen_recompute() -> None:
        h = hidden.clone().requires_grad_()
        # What head_nll ran with a frozen head before it formed the gradient in the forward.
        rows = loss._ChunkedHeadLoss.apply(h, targets, frozen, step, None)  # noqa: SLF001
        (rows * grad_out).sum().backward()

    sides = {"frozen_head_forward": frozen_forward, "frozen_head_recompute": frozen_recompute} if args.frozen_head \
        else {"fused_forward": fused, "recompute_backward": recompute}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds + 1):
        for name, fn in sides.items():
            weight.grad = None
            t0 = time.perf_counter()
            fn()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    result = {"benchmark": "loss_bench", "command": "python -m benchmarks.loss_bench " + " ".join(
        argv if argv is not None else sys.argv[1:]), "torch": torch.__version__, "threads": args.threads,
        "dtype": args.dtype, "frozen_head": args.frozen_head, "positions": args.positions, "hidden": args.hidden,
        "vocab": args.vocab,
        "chunk_positions": step, "seconds": {k: {"best": min(v), "median": statistics.median(v)}
                                             for k, v in times.items()}}
    for name, s in result["seconds"].items():
        print(f"{name}: best {s['best'] * 1e3:.0f} ms, median {s['median'] * 1e3:.0f} ms")
    (a, sa), (b, sb) = result["seconds"].items()
    print(f"{a} / {b}, best: {sa['best'] / sb['best']:.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
