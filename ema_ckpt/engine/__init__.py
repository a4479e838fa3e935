"""The engine: one loop over tensor data, region by region, every output at once.

:mod:`.regions` is the loop (fold, weighted sum, copy; :class:`OutputSpec`, :class:`Update`);
:mod:`.buffers` its reads into reused page-aligned buffers and its writes one region behind;
:mod:`.blas_probe` its row-block budgets and the check that one BLAS product per block has the
one-output loop's bits.

Example:
    >>> stats = combine_regions(sources, outputs, writers, regions, by_key)   # doctest: +SKIP
"""

from .regions import EngineStats, OutputSpec, Update, check_device, combine_regions

__all__ = ["EngineStats", "OutputSpec", "Update", "check_device", "combine_regions"]
