"""Block arithmetic for the engine: cache-sized row blocks, and a sweep's K × N block product
where this machine's BLAS gives the one-output loop's bits.

Example:
    >>> block_budget(8)
    524288
    >>> product_is_exact(2, 3, torch.float32) in (True, False)
    True
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from .._lazy import torch
from ..layout import Box, split_rows

# Row blocks of a region, per source: small enough to stay in the CPU's cache while every
# output uses them, so each input byte crosses memory once however many outputs there are.
_BLOCK_BYTES = 2 << 20
SWEEP_STACK_BYTES = 8 << 20
"""A sweep's block of every source at once (its matrix product's input), in bytes: kept in the
CPU's cache too."""
# With many outputs on the per-output path, the accumulators' blocks share the cache too: eight
# outputs on 2 MiB blocks cycle 16 MiB of accumulators per source, out of a busy shared L3
# (measured, 16 sources, 8 outputs: the arithmetic alone 0.6× as long on 512 KiB blocks, the
# whole run 12% less CPU). The budget divides about 4 MiB among them, between these bounds.
_ACCUMULATOR_SET_BYTES = 4 << 20
_MIN_BLOCK_BYTES = 512 << 10


def block_budget(accumulators: int) -> int:
    """Bytes of a row block when ``accumulators`` outputs fold or sum each source's block.

    >>> block_budget(1), block_budget(4), block_budget(8)
    (2097152, 1048576, 524288)
    """
    return max(_MIN_BLOCK_BYTES, min(_BLOCK_BYTES, _ACCUMULATOR_SET_BYTES // max(1, accumulators)))


def row_blocks(box: Box, itemsize: int, device: str, budget: int = _BLOCK_BYTES) -> list[Box]:
    """``box`` cut into row blocks of at most ``budget`` bytes; whole on a GPU or for a scalar."""
    if device != "cpu" or not box.sizes:  # a GPU wants large transfers
        return [box]
    return split_rows(box, max(1, budget // itemsize))


@dataclass(frozen=True, slots=True)
class Sweep:
    """Sum outputs over the same sources, computed as ``coefficients @ stack`` per block.

    ``coefficients`` is K × N (outputs × sources); ``stack`` holds the N sources' block as rows.
    A one-column block (a matrix-vector product to BLAS) is computed by the loop.
    """

    outputs: tuple[int, ...]
    members: frozenset[int]
    sources: tuple[int, ...]
    row_of: Mapping[int, int]
    coefficients: torch.Tensor

    def combine(self, stack: torch.Tensor, out: torch.Tensor) -> None:
        if stack.shape[1] >= 2:
            torch.mm(self.coefficients, stack, out=out)
            return
        _loop_product(self.coefficients, stack, out)


def _loop_product(coefficients: torch.Tensor, stack: torch.Tensor, out: torch.Tensor) -> None:
    """``coefficients @ stack`` into ``out`` as the one-output loop computes each row:
    ``acc = w₀·θ₀``, then ``acc += wₛ·θₛ`` (fused), source by source."""
    for row, weights in enumerate(coefficients.tolist()):
        torch.mul(stack[0], weights[0], out=out[row])
        for column in range(1, len(weights)):
            out[row].add_(stack[column], alpha=weights[column])


# Widths the probe tries: small ones (a BLAS's edge kernels), odd ones, and one past the sizes at
# which a BLAS switches to packed, blocked kernels.
_PROBE_WIDTHS = (2, 3, 5, 7, 16, 17, 64, 255, 1000, 4099, 65537)


@functools.cache
def product_is_exact(outputs: int, sources: int, dtype: torch.dtype) -> bool:
    """This machine's BLAS gives a K × N product (``outputs`` × ``sources``) the bits of the
    one-output loop (``acc = w₀·θ₀``, then ``acc += wₛ·θₛ`` fused, source by source).

    It depends on the BLAS and the processor, not the data (MKL on AMD groups terms otherwise),
    so it is tried once per shape on random values at the widths where kernels change.

    Example:
        >>> product_is_exact(4, 4, torch.float32) in (True, False)
        True
    """
    g = torch.Generator().manual_seed(outputs * 1000 + sources)
    coefficients = torch.randn(outputs, sources, dtype=torch.float64, generator=g).to(dtype)
    for width in _PROBE_WIDTHS:
        stack = torch.randn(sources, width, dtype=torch.float64, generator=g).to(dtype)
        # into columns of a wider buffer, as a block's product lands in its region's rows
        product = torch.empty(outputs, width + 3, dtype=dtype)[:, 1:width + 1]
        torch.mm(coefficients, stack, out=product)
        loop = torch.empty(outputs, width, dtype=dtype)
        _loop_product(coefficients, stack, loop)
        if not torch.equal(product, loop):
            return False
    return True
