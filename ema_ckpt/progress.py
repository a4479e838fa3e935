"""Progress reports passed to callbacks by long operations.

Example:
    >>> Progress(bytes_done=50, bytes_total=100, regions_done=1, regions_total=2, key="fc.weight").fraction
    0.5
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Progress:
    """Where a run stands, passed to the progress callback after each region."""

    bytes_done: int
    bytes_total: int
    regions_done: int
    regions_total: int
    key: str

    @property
    def fraction(self) -> float:
        """Share of the bytes done, 0 to 1."""
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0
