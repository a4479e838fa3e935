"""Trainer folders whose weights are ``torch.save`` files (transformers-4 ``checkpoint-N/``,
accelerate ``save_state()``): one weights file of a well-known name (:data:`WEIGHTS_FILES`), else
an index (``pytorch_model.bin.index.json``, or the folder's only ``*.bin.index.json``) naming
shard files. Files beside them (``optimizer.bin``, ``rng_state.pth``) are never the model; the
step comes from ``trainer_state.json``.

Example:
    >>> with TorchFolderReader("out/checkpoint-500") as reader:   # doctest: +SKIP
    ...     sorted(reader.specs())[:1]
    ['lm_head.weight']
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..._lazy import torch
from ...errors import CheckpointFormatError, CheckpointNotFoundError
from ...layout import Box, TensorSpec
from ...storage import Location, as_path
from ...torch_records.checks import ReadChecks
from ..base import CheckpointReader, trainer_state_step
from ..options import DEFAULT_READ, ReadOptions
from ..safetensors.reader import read_index
from .reader import TorchFileReader, file_kind

WEIGHTS_FILES = ("pytorch_model.bin", "pytorch_model_fsdp.bin", "pytorch_model_fsdp_0.bin", "adapter_model.bin",
                 "diffusion_pytorch_model.bin", "model.bin", "model.pt", "model.pth")
"""Weights files a trainer names so, most usual first."""
INDEX_FILE = "pytorch_model.bin.index.json"
INDEX_SUFFIX = ".bin.index.json"
_SHARD = re.compile(r"-\d+-of-\d+\.bin$")
_OTHER_MODELS = re.compile(r"^(pytorch_model(_fsdp)?|model)_[1-9]\d*\.(bin|safetensors)$")
"""accelerate's second and later models (``pytorch_model_1.bin``): not the first model's weights."""


def locate(path: Location) -> tuple[Location | None, list[Location]] | None:
    """``(index, [])`` or ``(None, [weights file])`` of a folder, or None when it holds neither."""
    if not path.is_dir():
        return None
    for name in WEIGHTS_FILES:
        if (path / name).is_file():
            return None, [path / name]
    if (path / INDEX_FILE).is_file():
        return path / INDEX_FILE, []
    indexes = [p for p in path.iterdir() if p.name.endswith(INDEX_SUFFIX) and not p.name.startswith(".")
               and p.is_file()]
    return (indexes[0], []) if len(indexes) == 1 else None


def missing_files(path: Location) -> str | None:
    """Why a folder's weights are not all there yet (a save in progress), or None."""
    located = locate(path)
    if located is None:
        shards = [p.name for p in path.iterdir() if _SHARD.search(p.name)] if path.is_dir() else []
        return f"{len(shards)} shard file(s) but no {INDEX_SUFFIX} (save in progress?)" if shards else None
    index, files = located
    if index is None:
        return f"{files[0].name} is truncated: no zip directory at its end (still being written?)" if (
            file_kind(files[0]) == "partial-zip") else None
    try:
        names = sorted(set(read_index(index)[0].values()))
    except CheckpointFormatError:
        return None
    missing = [n for n in names if not (index.parent / n).is_file() or file_kind(index.parent / n) == "partial-zip"]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        return f"index names {len(missing)} shard file(s) not complete yet: {shown} (save in progress?)"
    return None


def is_weights_folder(path: Location) -> bool:
    return locate(path) is not None and missing_files(path) is None


class TorchFolderReader(CheckpointReader):
    """Reader for a folder of ``torch.save`` weights (see the module docstring)."""

    format_name = "torch"
    whole_file_records = True

    def __init__(self, path: str | Location, options: ReadOptions = DEFAULT_READ) -> None:
        self.path = as_path(path)
        self.read_options = options
        located = locate(self.path)
        if located is None:
            raise CheckpointNotFoundError(self.path, f"no {' or '.join(WEIGHTS_FILES[:2])} or {INDEX_FILE}")
        index, files = located
        self.index = index
        weight_map: dict[str, str] = {}
        if index is not None:
            weight_map = read_index(index)[0]
            files = [index.parent / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointNotFoundError(index, f"names missing shard file(s): {', '.join(missing)} "
                                                     "(save in progress?)")
        self._readers: list[TorchFileReader] = []
        by_name: dict[str, TorchFileReader] = {}
        self.read_checks = ReadChecks(lambda name: by_name[name].path,
                                      lambda name, n, offset: by_name[name].read_back(n, offset))
        try:
            for file in files:
                self._readers.append(TorchFileReader(file, options, checks=self.read_checks))
                by_name[file.name] = self._readers[-1]
        except BaseException:
            self.close()
            raise
        self._where: dict[str, TorchFileReader] = {}
        self._specs: dict[str, TensorSpec] = {}
        for reader in self._readers:
            for key, spec in reader.specs().items():
                if key in self._where:
                    raise CheckpointFormatError(self.path, f"{key!r} is in both {self._where[key].path.name} and "
                                                           f"{reader.path.name}")
                if index is not None and weight_map.get(key) != reader.path.name:
                    where = f"maps it to {weight_map[key]}" if key in weight_map else "does not list it"
                    raise CheckpointFormatError(index, f"{reader.path} holds {key!r} but the index {where}")
                self._where[key], self._specs[key] = reader, spec
        unheld = [k for k in weight_map if k not in self._where]
        if unheld and index is not None:
            raise CheckpointFormatError(index, f"maps {unheld[0]!r} to {weight_map[unheld[0]]}, which does not hold it")
        self.step: int | None = trainer_state_step(self.path)
        self.others = sorted(p.name for p in self.path.iterdir() if _OTHER_MODELS.match(p.name))

    def specs(self) -> Mapping[str, TensorSpec]:
        return self._specs

    def layout(self, key: str) -> Sequence[Box]:
        return self._where[key].layout(key)

    def read(self, key: str, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._where[key].read(key, box, out)

    @classmethod
    def step_of(cls, path: Location) -> int | None:
        """``trainer_state.json``'s ``global_step`` beside the weights, as :attr:`step`."""
        return trainer_state_step(path)

    def stored_records(self) -> Sequence[tuple[str, int, int]]:
        return [(reader.path.name, offset, length) for reader in self._readers
                for _, offset, length in reader.stored_records()]

    def info(self) -> dict[str, Any]:
        first = self._readers[0].info() if self._readers else {}
        return {
            "files": [r.path.name for r in self._readers],
            "index": self.index.name if self.index is not None else None,
            "serialization": first.get("serialization"),
            "wrapper_prefix": first.get("wrapper_prefix"),
            "key_prefix": first.get("key_prefix"),
            "other_models": self.others,
            "step": self.step,
        }

    def close(self) -> None:
        for reader in self._readers:
            reader.close()


__all__ = ["INDEX_FILE", "WEIGHTS_FILES", "TorchFolderReader", "is_weights_folder", "locate", "missing_files"]
