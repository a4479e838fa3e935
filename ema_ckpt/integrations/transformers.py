"""``EmaCkptCallback`` for ``transformers.Trainer``: the EMA of every checkpoint the Trainer saves.

After each save, the new ``checkpoint-<step>`` folder is staged at once (so ``save_total_limit``
deleting it loses nothing) and folded into ``out`` by a separate process running
:func:`ema_ckpt.watch`, one fold at a time, on the CPU; at ``on_train_end`` the callback waits for
the folds left and logs the EMA's step and path. Only global rank 0 stages and folds. Every
checkpoint the Trainer writes is folded (``model.safetensors``, DeepSpeed ZeRO, FSDP); a resumed
run with the same ``out`` continues the same EMA. A failed fold is logged in one line and training
goes on (``strict=True``: raised at the end of training). Example: :class:`EmaCkptCallback`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import EmaCkptError
from ._background import BackgroundFolds, FoldsDone
from ._options import callback_options

if TYPE_CHECKING:  # transformers is typed, but far too large for mypy to follow: its hooks take Any
    TrainerCallback = object
else:
    from transformers import TrainerCallback

logger = logging.getLogger("ema_ckpt")

PREFIX_CHECKPOINT_DIR = "checkpoint"
"""The Trainer's checkpoint folders: ``checkpoint-<global_step>`` (``transformers.trainer_utils``)."""


class EmaCkptCallback(TrainerCallback):
    """Fold every checkpoint the ``transformers.Trainer`` saves into the EMA at ``out``.

    The keyword arguments from ``snapshot_every`` on, but ``strict`` and ``folder``, are :func:`~ema_ckpt.accumulate`'s.

    Args:
        out: the EMA directory (a relative path is taken from the current directory now).
        decay, half_life, sigma_rel, gamma: the profile, exactly one (``sigma_rel``/``gamma``:
            power EMAs, a value or a list; :func:`~ema_ckpt.accumulate`'s ``sigma_rels``/``gammas``).
        strict: raise :class:`~ema_ckpt.errors.FoldError` at the end of training when a fold
            failed (else each failure is logged and training ends normally).
        folder: the folder the Trainer saves into (default: ``args.output_dir``).

    Raises:
        UsageError, OptionError: a contradictory or bad option (at construction, before training).

    After training, :attr:`result` holds the EMA's step, the steps folded and the failures.

    Example:
        >>> callback = EmaCkptCallback(out="runs/ema", decay=0.999)                 # doctest: +SKIP
        >>> Trainer(model, args, train_dataset=data, callbacks=[callback]).train()   # doctest: +SKIP
        >>> callback.result.step                                                     # doctest: +SKIP
        8000
    """

    def __init__(self, out: str | os.PathLike[str], *, decay: float | None = None, half_life: float | None = None,
                 sigma_rel: float | str | Sequence[float | str] | None = None,
                 gamma: float | str | Sequence[float | str] | None = None, snapshot_every: int | None = None,
                 warmup: bool = False, per_checkpoint: bool = False, dtype: str = "float32", strict: bool = False,
                 folder: str | os.PathLike[str] | None = None,
                 include: Sequence[str] = (), exclude: Sequence[str] = (), step_regex: str | None = None,
                 step_from: str | None = None, component: str | None = None, keep_prefix: bool = False,
                 restart: bool = False, allow_new_keys: bool = False, average_buffers: bool = False,
                 skip_nonfinite: bool = False, skip_damaged: bool = False, skip: Sequence[str] = (),
                 state_key: str | None = None, inert_globals: Sequence[str] = ()) -> None:
        self.options = callback_options(locals())
        text = os.fspath(out)
        self.out = text if "://" in text else os.path.abspath(text)
        self.folder = None if folder is None else os.path.abspath(os.fspath(folder))
        self.strict = strict
        self.result: FoldsDone | None = None
        self._folds: BackgroundFolds | None = None
        self._failures: list[str] = []

    # ---- the Trainer's hooks --------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self._folds is not None:  # a second train() with the same callback: end the first run's folds
            self._end()
        folder = self.folder or os.path.abspath(args.output_dir)
        self._folds = BackgroundFolds(folder, out=self.out, options=self.options)
        self._failures = []
        self._stage_left_over(Path(folder))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero or self._folds is None:
            return
        checkpoint = self._folds.folder / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not checkpoint.is_dir():
            self._failed(f"{checkpoint}: not found after the Trainer's save (an output_dir per trial?); "
                         "not folded")
            return
        self._saved(checkpoint)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._folds is not None:
            self._folds.poll()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and self._folds is not None:
            self._end()

    # ---- the work -------------------------------------------------------------------------------

    def _saved(self, checkpoint: Path) -> None:
        assert self._folds is not None
        try:
            self._folds.saved(checkpoint)
        except OSError as err:  # could not be staged (refused links and copies): lost to the EMA
            self._failed(f"{checkpoint}: could not be staged for folding ({err.strerror or err})")

    def _stage_left_over(self, folder: Path) -> None:
        """Stage the checkpoints of ``folder`` newer than the EMA (a run that stopped before they
        were folded), before this run's first save can rotate them away."""
        from ..discovery import discover
        from ..watching import ema_step

        if not folder.is_dir():
            return
        try:
            step = ema_step(self.out)
            found = discover([folder], step_regex=self.options.get("step_regex"), all_components=True,
                             exclude=[] if "://" in self.out else [self.out], require=False)
        except EmaCkptError as err:
            logger.warning("ema-ckpt: cannot look for checkpoints left to fold in %s: %s", folder,
                           str(err).splitlines()[0])
            return
        for checkpoint in found.checkpoints:
            if step is None or checkpoint.step > step:
                self._saved(Path(str(checkpoint.entry)))

    def _failed(self, message: str) -> None:
        self._failures.append(message)
        logger.warning("ema-ckpt: %s", message)

    def _end(self) -> None:
        folds, self._folds = self._folds, None
        assert folds is not None
        done = folds.finish()
        done.errors[:] = dict.fromkeys(self._failures + done.errors)  # a checkpoint that stays bad: said once
        self.result = done
        if self.strict:
            done.check()


__all__ = ["EmaCkptCallback"]
