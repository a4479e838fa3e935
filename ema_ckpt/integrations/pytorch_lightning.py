"""``EmaCkptCallback`` for ``pytorch_lightning``: an EMA of every checkpoint the run saves.

Each checkpoint that any ``ModelCheckpoint`` writes (single ``.ckpt`` files, and the sharded
folders of the FSDP and DeepSpeed strategies) is staged by hard links the moment this callback
sees it, before retention (``save_top_k=1``) can remove it, and folded into the EMA at ``out`` by
a separate process running :func:`ema_ckpt.watch`: one fold at a time, in step order, no
accelerator memory. Only global rank 0 folds. At the end of training the callback waits for the
folds left and logs the EMA's step and path; a fold that fails is logged in one line and training
goes on (``strict=True``: :class:`~ema_ckpt.errors.FoldError` at the end of training). A resumed
run with the same ``out`` continues the same EMA.

Example:
    >>> import pytorch_lightning as pl                                                     # doctest: +SKIP
    >>> from pytorch_lightning.callbacks import ModelCheckpoint                            # doctest: +SKIP
    >>> from ema_ckpt.integrations.pytorch_lightning import EmaCkptCallback                # doctest: +SKIP
    >>> trainer = pl.Trainer(max_steps=10_000, callbacks=[                                  # doctest: +SKIP
    ...     ModelCheckpoint(dirpath="ckpts", every_n_train_steps=500, save_top_k=1),
    ...     EmaCkptCallback("ckpts/ema", decay=0.999)])
    >>> trainer.fit(model)                                                                 # doctest: +SKIP
    >>> ema_ckpt.consolidate("ckpts/ema", "ema.ckpt")                                      # doctest: +SKIP
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
    """Keep an EMA of every checkpoint that the run's ``ModelCheckpoint`` callbacks write.

    Args:
        out: the EMA's folder.
        decay, half_life, sigma_rel, gamma: the profile, exactly one (as :func:`ema_ckpt.accumulate`:
            ``sigma_rel`` a float or a list of them, for power EMAs).
        snapshot_every: with power EMAs, keep a snapshot every K steps (for ``ema-ckpt posthoc``).
        warmup, per_checkpoint, dtype: as :func:`ema_ckpt.accumulate`.
        strict: raise :class:`~ema_ckpt.errors.FoldError` at the end of training if a fold failed.
        more: other options of :func:`ema_ckpt.accumulate` (``include``, ``skip_damaged``, ...).

    Raises:
        UsageError, OptionError: no profile or two, or a bad option (at construction).

    Example:
        >>> EmaCkptCallback("ckpts/ema", decay=0.999)                  # doctest: +SKIP
        >>> EmaCkptCallback("ckpts/ema", sigma_rel=[0.05, 0.10], snapshot_every=1000)  # doctest: +SKIP
    """


__all__ = ["EmaCkptCallback", "FoldsDone"]
