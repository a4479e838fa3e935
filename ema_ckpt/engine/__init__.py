"""The engine: one loop over tensor data, region by region, every output at once.

Example:
    >>> stats = combine_regions(sources, outputs, writers, regions, by_key)   # doctest: +SKIP
"""

from .regions import EngineStats, OutputSpec, Update, check_device, combine_regions

__all__ = ["EngineStats", "OutputSpec", "Update", "check_device", "combine_regions"]
