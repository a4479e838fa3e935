"""The ``torch`` output (a ``.pt``/``.bin``/``.pth`` file of a flat state dict) and the
``lightning`` output (a ``.ckpt`` that ``load_from_checkpoint`` loads).

Example:
    >>> from pathlib import Path; from ema_ckpt.writers.base import output_format
    >>> out = output_format("torch").make(Path("staging"), "ema.pt")
    >>> out.single_file, str(out.shown_path)
    (True, 'staging/ema.pt')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dtypes import torch_dtype
from ...errors import OutputError
from ...writers.base import OutputFormat, OutputTensor, OutputWriter, PlannedRegion, WrittenFile, register_output
from ...writers.regions import BLOCK_BYTES, row_block_regions

if TYPE_CHECKING:
    import torch

    from ..base import CheckpointReader


class TorchFileOutput(OutputWriter):
    """A ``torch.save``-format file of a flat state dict, streamed in row blocks
    (``torch.load(weights_only=True)`` reads it)."""

    name = "torch"
    single_file = True

    def __init__(self, staging: Path, final_name: str, *, block_bytes: int = BLOCK_BYTES) -> None:
        super().__init__(staging, final_name)
        self.block_bytes = block_bytes
        self._tensors: dict[str, OutputTensor] = {}
        self._writer: Any = None
        self._size: dict[str, int] = {}

    def plan(self, tensors: Sequence[OutputTensor], source: CheckpointReader) -> list[PlannedRegion]:
        self._tensors = {t.key: t for t in tensors}
        return row_block_regions(tensors, source, self.final_name, self.block_bytes)

    def wrap(self) -> Callable[[bytes], bytes] | None:
        """What the file's pickle holds around the state dict (None: the state dict alone)."""
        return None

    def write(self, region: PlannedRegion, tensor: torch.Tensor) -> None:
        if self._writer is None:
            from ...torch_records import StateDictFileWriter

            wrap = self.wrap()
            self._writer = self._guarded(lambda: StateDictFileWriter(
                self.staging / self.final_name,
                [(t.name, t.shape, torch_dtype(t.dtype)) for t in self._tensors.values()], wrap=wrap))
        self._guarded(lambda: self._writer.write(self._tensors[region.key].name, tensor))

    def close(self) -> dict[str, int]:
        if self._writer is not None:
            self._size[self.final_name] = self._guarded(self._writer.finish)
            self._writer = None
        return dict(self._size)

    def _guarded(self, step: Any) -> Any:
        try:
            return step()
        except OSError as err:
            raise OutputError(f"{self.staging / self.final_name}: write failed ({err.strerror})") from None

    def finish(self, states: Sequence[Any]) -> list[WrittenFile]:
        sizes = {name: size for state in states for name, size in state.items()}
        return [WrittenFile(self.final_name, sizes[self.final_name])]

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


class LightningCheckpointOutput(TorchFileOutput):
    """A Lightning checkpoint (``.ckpt``): the weights as its ``state_dict``, beside the source's
    own entries that hold no tensor (``hyper_parameters``, ``epoch``, ``global_step``, carried
    from a single file or a sharded checkpoint's ``meta.pt``), so ``load_from_checkpoint`` loads
    it; ``pytorch-lightning_version`` is added when the source had none."""

    name = "lightning"

    def wrap(self) -> Callable[[bytes], bytes]:
        from ...torch_records.emit import wrap_pickle
        from .reader import carried_trainer_state

        beside = carried_trainer_state(self.carried, str(self.shown_path), self.carried_read.inert_globals)
        beside.setdefault("pytorch-lightning_version", _lightning_version())
        return lambda inner: wrap_pickle(inner, "state_dict", beside)


def _lightning_version() -> str:
    """The installed Lightning's version (read from its metadata, never imported), else 2.0.0."""
    import importlib.metadata

    for distribution in ("lightning", "pytorch-lightning"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "2.0.0"


register_output(OutputFormat("torch", TorchFileOutput, suffixes=(".pt", ".bin", ".pth", ".tar"), single_file=True))
register_output(OutputFormat("lightning", LightningCheckpointOutput, suffixes=(".ckpt",), single_file=True))
