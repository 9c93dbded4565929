"""Which row counts of an fp32 ``linear`` give rows that differ from those of a long product.

The HF engine's shared prompt prefill (``graftrl.models.shared_prefill``) computes the prompts'
last-position logits as a P-row product where ``generate`` computes them as P*n rows; the samples
are the same bit for bit only where a row's result does not depend on how many rows share the
product. This prints, per thread count, the row counts M (1..--max-rows) whose rows differ from the
same rows of a --reference-rows product, for the embedded models' layer shapes
(``SHARE_FROM_PROMPTS`` is chosen above all of them):

    .venv/bin/python benchmarks/batch_invariance.py --threads 1,2,4,8
"""

from __future__ import annotations

import argparse

import torch

SHAPES = [(128, 128), (128, 384), (384, 128), (128, 512), (512, 128), (128, 101), (128, 266)]
"""(in, out) features of the embedded Llama's and GPT-2's projections, MLPs and LM heads."""


def differing_row_counts(threads: int, max_rows: int, reference_rows: int, seed: int = 0) -> list[int]:
    """The M in 1..max_rows for which linear(x[:M]) differs from linear(x)[:M] for some shape."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(seed)
    differing: set[int] = set()
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        x = torch.randn(reference_rows, in_features, generator=generator)
        reference = torch.nn.functional.linear(x, weight, bias)  # [reference_rows, out]
        for rows in range(1, max_rows + 1):
            if not torch.equal(torch.nn.functional.linear(x[:rows], weight, bias), reference[:rows]):
                differing.add(rows)
    return sorted(differing)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--reference-rows", type=int, default=4096)
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()}")
    for threads in (int(t) for t in args.threads.split(",")):
        rows = differing_row_counts(threads, args.max_rows, args.reference_rows)
        print(f"{threads} thread(s): rows differ at M = {rows or 'none'} (of 1..{args.max_rows})")


if __name__ == "__main__":
    main()
