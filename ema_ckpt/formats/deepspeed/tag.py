"""The files of a DeepSpeed tag folder: found, sorted by rank, loaded once each (memory-mapped,
or on object storage their structure only, several at a time), and checked."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...errors import CheckpointFormatError
from ...storage import Location, remote_concurrency
from .files import OPTIM_RE, UNSUPPORTED_FILES, ZERO3_MODEL_RE, ds_files, model_files, name_gaps, structure_or_name
from .structure import RemoteStructure
from .unpickle import load_ds_file_releasable


class TagFiles:
    """Finding, loading and checking a tag folder's files (a base of :class:`~.reader.DeepSpeedReader`)."""

    tag_dir: Location
    stage: int
    world_size: int
    optimizer_kind: str
    _optim_files: list[Location]
    _model_files: list[Location]
    _states: dict[Location, Any]
    _releasable: dict[Location, bool]
    _identities: dict[Location, tuple[int, ...]]
    _structures: dict[Location, RemoteStructure]
    _sizes: dict[Location, int]

    def _refuse_unsupported_files(self) -> None:
        children: list[Location] = sorted(self.tag_dir.iterdir(), key=str)
        for child in children:
            name = child.name
            if child.is_dir() and name == "offloaded_tensors":
                raise CheckpointFormatError(child, "NVMe-offloaded optimizer state is not supported")
            for pattern, what in UNSUPPORTED_FILES:
                if pattern.match(name):
                    raise CheckpointFormatError(child, f"{what} are not supported")
            m = re.search(r"mp_rank_(\d+)", name)
            if m and int(m.group(1)) != 0 and name.endswith(".pt"):
                raise CheckpointFormatError(child, "tensor-parallel checkpoints (mp_rank_01 and up) are not supported")

    def _index_files(self) -> bool:
        """Sort the rank files by data-parallel rank; refuse names this reader does not know.
        True when the optimizer files are named ``bf16_*``."""
        models, optims = ds_files(self.tag_dir)
        parsed = []
        for p in optims:
            m = OPTIM_RE.match(p.name)
            if m is None:
                raise CheckpointFormatError(p, "unrecognised optimizer-states file name")
            parsed.append((int(m.group(2)), p, bool(m.group(1))))
        parsed.sort(key=lambda t: t[0])
        self._optim_files = [p for _, p, _ in parsed]
        reason = name_gaps(self.tag_dir)
        if reason:
            raise CheckpointFormatError(self.tag_dir, reason)
        self._model_files = model_files(models)
        if not self._model_files:
            raise CheckpointFormatError(models[0], "unrecognised model-states file name")
        return any(bf16 for _, _, bf16 in parsed)

    def _load_remote(self, paths: Sequence[Location]) -> None:
        """Load the structure of every object in ``paths`` not loaded yet, several at a time (a few
        small requests each: latency is their cost); files mapped by name are left to :meth:`_load`."""
        todo = [p for p in paths if p not in self._states]
        if len(todo) < 2:
            return
        with ThreadPoolExecutor(min(len(todo), remote_concurrency()), thread_name_prefix="ema-ckpt-ds") as pool:
            loaded = dict(zip(todo, pool.map(_structure_of, todo), strict=True))
        for path, found in loaded.items():
            if isinstance(found, RemoteStructure):
                self._keep(path, found)

    def _keep(self, path: Location, structure: RemoteStructure) -> None:
        self._structures[path] = structure
        self._states[path], self._releasable[path] = structure.state, False
        self._sizes[path] = structure.source.size

    def _load(self, path: Location) -> Any:
        if path in self._states:
            return self._states[path]
        found = _structure_of(path)
        if isinstance(found, RemoteStructure):
            self._keep(path, found)
            return found.state
        # The identity is kept only if the name still names the file mapped; pread checks it on
        # every open, so a tag folder rewritten meanwhile is never read partly from the new file.
        before = _identity(found)
        self._states[path], self._releasable[path] = load_ds_file_releasable(found)
        if before is not None and before == _identity(found):
            self._identities[path] = before
        return self._states[path]

    def _check_states(self, model0_path: Location, model0: Any) -> list[dict[str, Any]]:
        """Stage, world size and file counts; returns each rank's ``optimizer_state_dict``."""
        tag_dir = self.tag_dir
        if not isinstance(model0, dict) or "buffer_names" not in model0:
            raise CheckpointFormatError(model0_path, "not a DeepSpeed model-states file (no buffer_names)")
        for moe_key in ("num_experts", "ds_autoep_layers", "ds_autoep_layers_v1"):
            if model0.get(moe_key):
                raise CheckpointFormatError(model0_path,
                                            f"mixture-of-experts checkpoints ({moe_key}) are not supported")
        if model0.get("mp_world_size", 1) not in (None, 1):
            raise CheckpointFormatError(model0_path, f"tensor-parallel checkpoints (mp_world_size="
                                                     f"{model0['mp_world_size']}) are not supported")
        self._load_remote([*self._optim_files, *self._model_files])
        osds = []
        for p in self._optim_files:
            state = self._load(p)
            osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
            if not isinstance(osd, dict):
                raise CheckpointFormatError(p, "not a DeepSpeed optimizer-states file (no optimizer_state_dict)")
            osds.append(osd)
        osd0, optim0 = osds[0], self._optim_files[0]
        if "zero_stage" in osd0:
            self.stage = int(osd0["zero_stage"])
            self.optimizer_kind = "zero"
        elif "single_partition_of_fp32_groups" in osd0:
            self.stage = 1  # BF16_Optimizer: ZeRO-1 layout, no zero_stage, no loss scaler
            self.optimizer_kind = "bf16_optimizer"
        else:
            raise CheckpointFormatError(optim0, "not a ZeRO checkpoint (no zero_stage)")
        if self.stage not in (1, 2, 3):
            raise CheckpointFormatError(optim0, f"ZeRO stage {self.stage} is not supported")
        counts = osd0.get("partition_count")
        if isinstance(counts, list | tuple):
            if len(set(counts)) > 1:
                raise CheckpointFormatError(optim0, f"parameter groups are split over different rank counts "
                                                    f"{list(counts)} (expert or hierarchical partitioning), which is "
                                                    "not supported")
            counts = counts[0] if counts else None
        if not isinstance(counts, int) or counts < 1:
            raise CheckpointFormatError(optim0, f"bad partition_count {osd0.get('partition_count')!r}")
        self.world_size = counts
        if counts != len(self._optim_files):
            raise CheckpointFormatError(tag_dir, f"expected {counts} *_optim_states.pt files (partition_count) but "
                                                 f"found {len(self._optim_files)}: an old checkpoint was overwritten, "
                                                 "a rank did not save, or the run used hierarchical partitioning "
                                                 "(MiCS/hpZ), which is not supported")
        if self.stage == 3 and len(self._model_files) != counts:
            message = f"expected {counts} ZeRO-3 model-states files but found {len(self._model_files)}"
            raise CheckpointFormatError(tag_dir, message)
        if self.stage < 3 and ZERO3_MODEL_RE.match(self._model_files[0].name):
            message = f"ZeRO-3 model-states file in a stage-{self.stage} checkpoint"
            raise CheckpointFormatError(self._model_files[0], message)
        return osds


def _structure_of(path: Location) -> RemoteStructure | str:
    """:func:`~.files.structure_or_name`, a model-states file's shared per version."""
    return structure_or_name(path, shared=path.name.endswith("model_states.pt"))


def _identity(name: str) -> tuple[int, ...] | None:
    try:
        return file_identity(os.stat(name))
    except OSError:
        return None


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells one version of a file from another."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
