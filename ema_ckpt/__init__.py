"""ema-ckpt: EMAs and averages of sharded PyTorch checkpoints, computed offline."""

from ._version import __version__

__all__ = ["__version__"]
