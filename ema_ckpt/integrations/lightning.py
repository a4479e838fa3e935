"""``EmaCkptCallback`` for ``lightning.pytorch``: an EMA of every checkpoint the run saves.

Each checkpoint any ``ModelCheckpoint`` writes (``.ckpt`` files, the FSDP and DeepSpeed
strategies' folders) is staged the moment this callback sees it, before retention can remove
it, and folded into ``out`` by a separate process running :func:`ema_ckpt.watch`, with no
accelerator memory; only global rank 0 folds. At the end of training the callback waits for the
folds left; a failed fold is logged in one line (``strict=True``: :class:`~ema_ckpt.errors.FoldError`
at the end of training). A resumed run with the same ``out`` continues the same EMA.

Example:
    >>> import lightning.pytorch as pl                                                     # doctest: +SKIP
    >>> from lightning.pytorch.callbacks import ModelCheckpoint                             # doctest: +SKIP
    >>> from ema_ckpt.integrations.lightning import EmaCkptCallback                        # doctest: +SKIP
    >>> trainer = pl.Trainer(max_steps=10_000, callbacks=[                                  # doctest: +SKIP
    ...     ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500, save_top_k=1),
    ...     EmaCkptCallback("ckpts/ema", decay=0.999)])
    >>> trainer.fit(model)                                                                 # doctest: +SKIP
    >>> ema_ckpt.consolidate("ckpts/ema", "ema.ckpt")                                      # doctest: +SKIP
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback  # type: ignore[import-not-found, unused-ignore]
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("ema_ckpt.integrations.lightning needs the `lightning` package (pip install lightning); "
                      "for `pytorch_lightning` use ema_ckpt.integrations.pytorch_lightning") from err

from ._background import FoldsDone
from ._lightning_core import LightningEmaCore


class EmaCkptCallback(LightningEmaCore, Callback):  # type: ignore[misc, unused-ignore]
    """Keep an EMA of every checkpoint that the run's ``ModelCheckpoint`` callbacks write (arguments:
    :class:`~ema_ckpt.integrations._lightning_core.LightningEmaCore`)."""


__all__ = ["EmaCkptCallback", "FoldsDone"]
