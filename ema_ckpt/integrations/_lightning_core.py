"""The one implementation behind both Lightning callbacks (``lightning.pytorch`` and
``pytorch_lightning``): :class:`LightningEmaCore` takes no Lightning import, each public module
mixes it into its own package's ``Callback``.

How no checkpoint is missed with ``save_top_k=1``:

- Lightning moves every ``Checkpoint`` callback to the end of the list, so in each hook where
  ``ModelCheckpoint`` may save, this callback runs first: a checkpoint written at one hook is
  seen at this callback's next hook, before the next save, the only moment retention removes
  the previous file. At each hook, global rank 0 stages what is new among every
  ``ModelCheckpoint``'s ``best_k_models``, ``best_model_path``, ``last_model_path`` and folder.
- As a second guard, ``trainer.strategy.remove_checkpoint`` is wrapped for the run: a checkpoint
  retention removes is staged first if it was not yet (``trainer.save_checkpoint`` in user code).
- ``last.ckpt`` is written again under the same name at each save, possibly in place: it is
  staged as a copy under a unique name (``last.<mtime>.ckpt``). A ``save_last="link"`` symlink
  is not staged (its target is).
- The last save may happen in ``ModelCheckpoint.on_train_end``, after this callback's: the final
  look and the wait for the folds are in ``on_fit_end``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import OptionError, UsageError, one_line
from ..watching import INCOMING, incoming_dir
from ._background import BackgroundFolds, FoldsDone
from ._options import callback_options

logger = logging.getLogger("ema_ckpt")

_LAST_PREFIX = "last"


def _step_of(path: Path) -> tuple[int | None, str | None]:
    """The step of the checkpoint at ``path`` as the folds will see it, or why it is unreadable."""
    from ..discovery import discover

    try:
        found = discover([path], all_components=True, require=False)
    except Exception as err:  # the fold will say why, in one line
        return None, one_line(err)
    return (found.checkpoints[0].step if len(found.checkpoints) == 1 else None), None


class LightningEmaCore:
    """Keep an EMA of every checkpoint that the run's ``ModelCheckpoint`` callbacks write.

    Mixed into the ``Callback`` of ``lightning.pytorch`` or of ``pytorch_lightning`` by
    :mod:`ema_ckpt.integrations.lightning` / :mod:`ema_ckpt.integrations.pytorch_lightning`.

    The keyword arguments from ``snapshot_every`` on, but ``strict``, are :func:`ema_ckpt.accumulate`'s.

    Args:
        out: the EMA's folder.
        decay, half_life, sigma_rel, gamma: the profile, exactly one (``sigma_rel``/``gamma``: power
            EMAs, a value or a list; :func:`ema_ckpt.accumulate`'s ``sigma_rels``/``gammas``).
        strict: raise :class:`~ema_ckpt.errors.FoldError` at the end of training if a fold failed.

    Raises:
        UsageError, OptionError: no profile or two, or a bad option (at construction).

    Example:
        >>> EmaCkptCallback("ckpts/ema", sigma_rel=[0.05, 0.10], snapshot_every=1000)  # doctest: +SKIP
    """

    def __init__(self, out: str | os.PathLike[str], *, decay: float | None = None, half_life: float | None = None,
                 sigma_rel: float | str | Sequence[float | str] | None = None,
                 gamma: float | str | Sequence[float | str] | None = None, snapshot_every: int | None = None,
                 warmup: bool = False, per_checkpoint: bool = False, dtype: str = "float32", strict: bool = False,
                 include: Sequence[str] = (), exclude: Sequence[str] = (), step_regex: str | None = None,
                 step_from: str | None = None, component: str | None = None, keep_prefix: bool = False,
                 restart: bool = False, allow_new_keys: bool = False, average_buffers: bool = False,
                 skip_nonfinite: bool = False, skip_damaged: bool = False, skip: Sequence[str] = (),
                 state_key: str | None = None, inert_globals: Sequence[str] = ()) -> None:
        super().__init__()
        if out is None or str(out) == "":
            raise OptionError("out", "is the EMA's folder and is required", value=out)
        self.options = callback_options(locals())
        self.out = str(out)
        self.strict = strict
        self.result: FoldsDone | None = None
        self._folds: BackgroundFolds | None = None
        self._seen: set[tuple[str, int, int]] = set()
        self._steps: set[int] = set()
        self._strategy: Any = None

    # -- Lightning hooks --------------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or not trainer.is_global_zero:
            return
        folders = self._folders(trainer)
        if not folders:
            logger.warning("ema-ckpt: the trainer has no ModelCheckpoint: there is nothing to fold")
            return
        for folder in folders:
            if "://" in folder:
                raise UsageError(f"EmaCkptCallback folds checkpoints saved on a local disk; the ModelCheckpoint "
                                 f"saves to {folder} (run `ema-ckpt watch {folder}` beside the training instead)")
        self.result = None
        self._seen = set()
        self._steps = set()
        self._folds = BackgroundFolds(folders[0], out=self.out, options=self.options,
                                      ignore=self._rewritten_in_place(trainer))
        self._wrap_remove(trainer)

    def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        self._look(trainer)

    on_train_epoch_end = on_validation_end = on_train_end = on_train_batch_end

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(trainer, raise_errors=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):
            folds, self._folds = self._folds, None  # the staged checkpoints wait for the next run
            self._unwrap_remove()
            if folds is not None:
                logger.warning("ema-ckpt: training was interrupted; the EMA at %s folds the rest at the next run",
                               self.out)
            return
        self._end(trainer, raise_errors=False)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._unwrap_remove()

    # -- what the hooks do ------------------------------------------------------------------------------------

    def _end(self, trainer: Any, *, raise_errors: bool) -> None:
        folds = self._folds
        if folds is None:
            return
        self._look(trainer)
        self._folds = None
        self._unwrap_remove()
        self.result = folds.finish()
        logger.info("ema-ckpt: EMA at step %s: %s", self.result.step, self.out)
        if self.strict and raise_errors:
            self.result.check()

    @staticmethod
    def _checkpoint_callbacks(trainer: Any) -> list[Any]:
        return [cb for cb in getattr(trainer, "checkpoint_callbacks", []) if hasattr(cb, "best_k_models")]

    def _folders(self, trainer: Any) -> list[str]:
        return list(dict.fromkeys(str(cb.dirpath) for cb in self._checkpoint_callbacks(trainer)
                                  if cb.dirpath is not None))

    def _look(self, trainer: Any) -> None:
        """Stage every checkpoint of the ModelCheckpoints not staged yet (global rank 0 only)."""
        folds = self._folds
        if folds is None:
            return
        for path in self._candidates(trainer):
            self._stage(path)
        folds.poll()

    def _rewritten_in_place(self, trainer: Any) -> list[str]:
        """The ``last.ckpt`` files a ``ModelCheckpoint(save_last=True)`` writes again at each
        save: the worker must not hard-link them (they are staged as copies, see _stage)."""
        return [os.path.join(cb.dirpath, getattr(cb, "CHECKPOINT_NAME_LAST", _LAST_PREFIX)
                             + getattr(cb, "FILE_EXTENSION", ".ckpt"))
                for cb in self._checkpoint_callbacks(trainer)
                if cb.dirpath is not None and getattr(cb, "save_last", None) and cb.save_last != "link"]

    def _candidates(self, trainer: Any) -> list[str]:
        paths: list[Any] = []
        for cb in self._checkpoint_callbacks(trainer):
            paths += [*getattr(cb, "best_k_models", {}), getattr(cb, "best_model_path", ""),
                      getattr(cb, "last_model_path", "")]
            suffix = getattr(cb, "FILE_EXTENSION", ".ckpt")
            if cb.dirpath is not None and os.path.isdir(cb.dirpath):
                with os.scandir(cb.dirpath) as entries:
                    paths += [e.path for e in entries if not e.name.startswith(".") and e.name.endswith(suffix)]
        found = dict.fromkeys(str(path) for path in paths if path and "://" not in str(path))
        return sorted(found, key=lambda path: Path(path).name.startswith(_LAST_PREFIX))  # copies after

    def _stage(self, path: str) -> None:
        folds = self._folds
        if folds is None:
            return
        source = Path(path)
        try:
            if source.is_symlink():  # save_last="link": its target is staged under its own name
                return
            info = source.stat()
        except FileNotFoundError:
            return
        key = (os.path.abspath(path), info.st_ino, info.st_mtime_ns)
        if key in self._seen:
            return
        self._seen.add(key)
        step, unreadable = _step_of(source)
        if unreadable is not None:  # ModelCheckpoint wrote it whole: damaged, not incomplete
            folds.done.errors.append(unreadable)
            logger.warning("ema-ckpt: a fold failed (training goes on): %s", unreadable)
            return
        if step is not None and step in self._steps:
            return  # a copy of a step already staged (last.ckpt beside its step's file): folded once
        if step is not None:
            self._steps.add(step)
        if source.is_file() and source.name.startswith(_LAST_PREFIX):
            self._stage_copy(source, info.st_mtime_ns)
            return
        folds.saved(source)

    def _stage_copy(self, source: Path, version: int) -> None:
        """Stage a copy of a checkpoint that the trainer writes again under the same name."""
        folds = self._folds
        assert folds is not None
        incoming = incoming_dir(folds.folder)
        target = incoming / f"{source.stem}.{version}{source.suffix}"
        if target.exists():
            return
        incoming.mkdir(parents=True, exist_ok=True)
        partial = incoming / f".{target.name}.partial-{os.getpid()}"
        try:
            shutil.copy2(source, partial)
            os.replace(partial, target)
        except FileNotFoundError:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
            logger.warning("ema-ckpt: %s was gone before it could be staged; not folded", source)
            return
        folds.saved(target)  # already in place: stage() keeps it, and a fold starts

    def _wrap_remove(self, trainer: Any) -> None:
        """Stage a checkpoint before the strategy removes it, if it was not staged yet."""
        self._unwrap_remove()
        strategy = trainer.strategy
        original = strategy.remove_checkpoint

        def remove_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            if self._folds is not None and "://" not in str(filepath):
                try:
                    self._stage(str(filepath))
                except OSError as err:
                    logger.warning("ema-ckpt: could not stage %s before its removal: %s", filepath, err)
            return original(filepath, *args, **kwargs)

        strategy.remove_checkpoint = remove_checkpoint
        self._strategy = strategy

    def _unwrap_remove(self) -> None:
        strategy, self._strategy = self._strategy, None
        if strategy is not None and "remove_checkpoint" in vars(strategy):
            del strategy.remove_checkpoint


__all__ = ["INCOMING", "LightningEmaCore"]
