"""What the training data's digest (lisaft/data/digest.py) costs at start-up for a large data set:
`python benchmarks/digest_bench.py --examples 200000 --tokens 512` (102.4 M tokens) prints the
seconds and the tokens hashed per second. The examples are synthetic lists of ints, as tokenizing
leaves them; the digest's time grows with the token count only."""

from __future__ import annotations

import argparse
import time

from lisaft.data.digest import examples_digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=200_000)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per example")
    args = ap.parse_args()
    examples = [{"input_ids": [(i + j) % 128_000 for j in range(args.tokens)],
                 "labels": [(i + j) % 128_000 for j in range(args.tokens)]} for i in range(args.examples)]
    t0 = time.perf_counter()
    examples_digest(examples)
    seconds = time.perf_counter() - t0
    total = args.examples * args.tokens
    print(f"{args.examples:,} examples x {args.tokens} tokens = {total / 1e6:.1f} M tokens: digest in {seconds:.2f} s "
          f"({total / seconds / 1e6:.1f} M tokens/s)")


if __name__ == "__main__":
    main()
