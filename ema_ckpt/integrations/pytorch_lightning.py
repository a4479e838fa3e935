"""``EmaCkptCallback`` for ``pytorch_lightning``: as :mod:`ema_ckpt.integrations.lightning`'s, for the
package's older name.

Example:
    >>> from ema_ckpt.integrations.pytorch_lightning import EmaCkptCallback                # doctest: +SKIP
    >>> pl.Trainer(callbacks=[ModelCheckpoint(dirpath="ckpts", save_top_k=1),              # doctest: +SKIP
    ...                       EmaCkptCallback("ckpts/ema", decay=0.999)])
"""

from __future__ import annotations

try:
    from pytorch_lightning import Callback
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("ema_ckpt.integrations.pytorch_lightning needs the `pytorch_lightning` package "
                      "(pip install pytorch-lightning); for `lightning.pytorch` use "
                      "ema_ckpt.integrations.lightning") from err

from ._background import FoldsDone
from ._lightning_core import LightningEmaCore


class EmaCkptCallback(LightningEmaCore, Callback):
    """Keep an EMA of every checkpoint that the run's ``ModelCheckpoint`` callbacks write (arguments:
    :class:`~ema_ckpt.integrations._lightning_core.LightningEmaCore`)."""


__all__ = ["EmaCkptCallback", "FoldsDone"]
