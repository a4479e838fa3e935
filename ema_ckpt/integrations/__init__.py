"""The EMA kept from inside a training job: callbacks for the trainers' own callback systems.

- :mod:`ema_ckpt.integrations.transformers`: ``EmaCkptCallback`` for ``transformers.Trainer``;
- :mod:`ema_ckpt.integrations.lightning` / :mod:`ema_ckpt.integrations.pytorch_lightning`:
  ``EmaCkptCallback`` for ``lightning.pytorch`` / ``pytorch_lightning``.

Each stages every checkpoint the trainer saves (reflinked or hard-linked where it can: see
:mod:`ema_ckpt.staging`) and folds it in a separate process with :func:`ema_ckpt.watch`, one fold
at a time, in step order, with no accelerator memory. Importing :mod:`ema_ckpt` imports none of the trainers.
"""
