"""``reshard``: any supported checkpoint → a DCP checkpoint laid out for N ranks.

Each tensor is cut on dim 0 as FSDP2's ``fully_shard`` cuts it and rank r's chunks go to
``__r_0.distcp``, so each rank reads only its own file. Streams one chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import OUTPUT_DTYPES, is_float
from ..engine import OutputSpec, Update
from ..errors import Note, OptionError, UsageError
from ..job_context import JobContext
from ..jobs import Job, Target, run_job
from ..manifest import Manifest, check_not_overlapping
from ..options import RUNTIME, KeyFields, ReadFields, RunFields, command_options
from ..progress import Progress
from ..selection import carry_into, select_keys
from ..storage import Location, as_path, files_on_disk
from ..writers.base import OutputTensor, check_directory_output


@dataclass(frozen=True, kw_only=True)
class ReshardOptions(KeyFields, ReadFields, RunFields):
    """Everything a :func:`reshard` run needs; checked when made."""

    src: Location
    out: Location
    world_size: int
    dtype: str | None = None
    all_keys: bool = False
    overwrite: bool = field(default=False, metadata=RUNTIME)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_directory_output(self.out)
        if self.world_size < 1:
            raise OptionError("world_size", f"must be at least 1, got {self.world_size}", value=self.world_size)
        if self.dtype is not None and self.dtype not in OUTPUT_DTYPES:
            raise OptionError("dtype", f"must be one of {', '.join(OUTPUT_DTYPES)}, got {self.dtype!r}",
                              value=self.dtype)


@dataclass(slots=True)
class ReshardResult:
    """What :func:`reshard` wrote: ``files`` (name, size) on disk, ``.metadata`` and a manifest included."""

    out: Location
    world_size: int
    keys: int
    files: list[tuple[str, int]]
    bytes_written: int
    seconds: float
    notes: list[str] = field(default_factory=list)


def reshard(
    src: str | Location,
    *,
    world_size: int,
    out: str | Location,
    dtype: str | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    all_keys: bool = False,
    state_key: str | None = None,
    inert_globals: Sequence[str] = (),
    overwrite: bool = False,
    wait_seconds: float = 0.0,
    workers: int = 1,
    on_progress: Callable[[Progress], None] | None = None,
) -> ReshardResult:
    """Write ``src`` as a DCP checkpoint sharded on dim 0 for ``world_size`` ranks.

    Keys are kept as they are; ``all_keys`` carries non-model tensors (optimizer state) too.
    ``state_key`` and ``inert_globals``: for a single-file source, as for :func:`~ema_ckpt.accumulate`.

    Example:
        >>> reshard("ckpts/ema", world_size=8, out="ema-8").files[:1]   # doctest: +SKIP
        [('__0_0.distcp', 1048576)]
    """
    given = dict(locals())
    del given["on_progress"]
    options = ReshardOptions(**command_options(given) | {"src": as_path(src)})
    check_not_overlapping(options.src, options.out)
    return run_job(ReshardJob(options), on_progress=on_progress)


@dataclass(slots=True)
class _Written:
    keys: int
    files: list[tuple[str, int, int | None]]
    notes: list[str]


@dataclass
class ReshardJob(Job[None, _Written, ReshardResult]):
    """:func:`reshard` as a job of the runner (:mod:`ema_ckpt.jobs`)."""

    options: ReshardOptions

    def lock_path(self) -> Location:
        return self.options.out

    def plan(self, notes: list[str]) -> None:
        return None

    def targets(self, plan: None) -> list[Target]:
        return [Target(self.options.out, replace=self.options.overwrite)]

    def compute(self, plan: None, context: JobContext) -> _Written:
        opts = self.options

        def open_source() -> tuple[Any, list[str]]:
            [reader] = context.open_sources([opts.src])
            keys = list(reader.specs()) if opts.all_keys else select_keys(reader, opts.include, opts.exclude)
            if not keys:
                raise UsageError(f"{opts.src}: no tensor keys to write")
            return reader, keys

        reader, keys = context.check(open_source)
        stored = reader.stored()
        tensors = [OutputTensor(k, k, tuple(stored[k][0]),
                                opts.dtype if opts.dtype is not None and is_float(stored[k][1]) else stored[k][1],
                                stored[k][1]) for k in keys]
        notes: list[str] = []
        rows = max((t.shape[0] for t in tensors if t.shape), default=0)
        if opts.world_size > rows:
            notes.append(Note(f"{{world_size}} {opts.world_size} is more than the largest tensor's {rows} rows: "
                              f"ranks {rows} and above hold nothing", mentions=("world_size",)))
        writer = context.writer(0, "dcp", world_size=opts.world_size, max_file_bytes=None,
                                planner_data=reader.planner_data)
        carry_into([writer], reader, opts.include, opts.exclude)
        written = context.write([reader], [OutputSpec("reshard", (Update(0, 1.0),), mode="copy")], [writer],
                                tensors, layout=reader, copy_source=0)
        return _Written(len(keys), [(f.name, f.size, f.crc32) for f in written.files[0]], notes)

    def manifests(self, plan: None, computed: _Written) -> list[Manifest | None]:
        manifest = Manifest.read(self.options.src)
        if manifest is not None:  # an ema-ckpt output stays one, with its new files
            manifest.files = {name: {"size": size, "crc32": crc} for name, size, crc in computed.files}
        return [manifest]

    def result(self, plan: None, computed: _Written | None, seconds: float) -> ReshardResult:
        assert computed is not None
        files = files_on_disk(self.options.out)
        return ReshardResult(self.options.out, self.options.world_size, computed.keys, files,
                             sum(s for _, s in files), seconds, computed.notes)


__all__ = ["ReshardJob", "ReshardOptions", "ReshardResult", "reshard"]
