"""The arithmetic a sweep cannot skip, timed alone in a tight loop: the compute floor.

A sweep of K outputs over N inputs must, for every output byte, form the weighted sum of the
N inputs' values (one K × N by N × block matrix product per block where this machine's BLAS
gives the one-output loop's bits, else that loop) and checksum it (CRC-32,
required by the zip records DCP stores tensors in). This script times exactly that on
in-memory blocks, on one thread as the engine computes, with no reading, writing or Python per
tensor. Added to a run's I/O floor it gives the floor of a sweep that does the work its
format requires.

Usage: python benchmarks/sweep_compute_floor.py [--inputs 4] [--gib 1] [--outputs 1 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def compute_floor(inputs: int, outputs: int, total_bytes: int, block_bytes: int = 8 << 20) -> float:
    import torch

    from ema_ckpt._crc import crc32
    from ema_ckpt.engine.blas_probe import _loop_product, product_is_exact

    torch.set_num_threads(1)
    elements = block_bytes // 4 // inputs  # the engine's sweep stack holds N inputs' blocks in 8 MiB
    stack = torch.randn(inputs, elements)
    weights = torch.rand(outputs, inputs, dtype=torch.float64).float()
    result = torch.empty(outputs, elements)
    blocks = max(1, total_bytes // (elements * 4))
    # as the engine computes: the product where it has the loop's bits on this machine, else the loop
    product = outputs >= 2 and product_is_exact(outputs, inputs, torch.float32)
    started = time.perf_counter()
    for _ in range(blocks):
        if product:
            torch.mm(weights, stack, out=result)
        else:
            _loop_product(weights, stack, result)
        for k in range(outputs):
            crc32(memoryview(result[k].numpy()).cast("B"))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=4)
    parser.add_argument("--gib", type=float, default=1.0, help="bytes of each output, GiB")
    parser.add_argument("--outputs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for k in args.outputs:
        times = [compute_floor(args.inputs, k, int(args.gib * (1 << 30))) for _ in range(args.repeat)]
        print(f"N = {args.inputs}, K = {k}: {statistics.median(times):.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
