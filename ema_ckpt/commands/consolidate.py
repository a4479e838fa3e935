"""``consolidate``: any supported checkpoint → safetensors, the HF sharded layout, or a torch file.

Headers are written from metadata first, then each tensor's bytes block by block (or, for a
safetensors output with no cast, copied file to file); the output is built beside its final
path and swapped in.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..dtypes import OUTPUT_DTYPES, is_float
from ..engine import OutputSpec, Update
from ..errors import Note, OptionError, UsageError
from ..job_context import JobContext
from ..jobs import Job, Target, run_job
from ..layout import as_tuple
from ..manifest import check_not_overlapping
from ..options import RUNTIME, KeyFields, ReadFields, RunFields, command_options
from ..progress import Progress
from ..selection import carry_into, container_prefix, output_names, select_keys
from ..storage import Location, as_path, files_on_disk
from ..writers.base import OutputTensor, choose_output_format, ends_in_separator, output_format

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""Hugging Face's default shard limit."""


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``5GB`` (10⁹, as Hugging Face counts), ``500MiB`` or ``20KB``.

    Example:
        >>> parse_size("5GB"), parse_size("20KB"), parse_size("1MiB")
        (5000000000, 20000, 1048576)
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS:
        raise UsageError(f"size {text!r} not understood; use e.g. 5GB, 500MB, 20KB or 1GiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return value


@dataclass(frozen=True, kw_only=True)
class ConsolidateOptions(KeyFields, ReadFields, RunFields):
    """Everything a :func:`consolidate` run needs; checked when made (``format``: the one
    :func:`~ema_ckpt.writers.base.choose_output_format` chose for ``out``)."""

    src: Location
    out: Location
    format: str
    max_shard_size: str | int | None = None
    dtype: str | None = None
    overwrite: bool = field(default=False, metadata=RUNTIME)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_shard_size is not None:
            parse_size(self.max_shard_size)
            if output_format(self.format).single_file:
                raise OptionError("max_shard_size", f"shards a directory output, but {{out}} {self.out} is one "
                                  f"{self.format} file; name a directory (no file suffix) to shard it",
                                  value=self.max_shard_size, mentions=("out",))
        if self.dtype is not None and self.dtype not in OUTPUT_DTYPES:
            raise OptionError("dtype", f"must be one of {', '.join(OUTPUT_DTYPES)}, got {self.dtype!r}",
                              value=self.dtype)


@dataclass(slots=True)
class ConsolidateResult:
    """What :func:`consolidate` wrote: ``files`` (name, size) on disk, the index included."""

    out: Location
    layout: str
    files: list[tuple[str, int]] = field(default_factory=list)
    keys: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    renamed_prefix: str | None = None
    """The DCP container level removed from every key (``"model."``), or None."""
    notes: list[str] = field(default_factory=list)
    index: str | None = None
    """The file among ``files`` that names the others (the HF layout's index), or None."""
    carried: list[str] = field(default_factory=list)
    """Files among ``files`` carried from the source (``config.json``): not shards."""


def consolidate(
    src: str | Location,
    out: str | Location,
    *,
    format: str | None = None,
    max_shard_size: str | int | None = None,
    dtype: str | None = None,
    keep_prefix: bool = False,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    state_key: str | None = None,
    inert_globals: Sequence[str] = (),
    overwrite: bool = False,
    wait_seconds: float = 0.0,
    workers: int = 1,
    on_progress: Callable[[Progress], None] | None = None,
) -> ConsolidateResult:
    """Stream the checkpoint at ``src`` into one loadable file or an HF sharded folder.

    Args:
        src: any supported checkpoint (an ema-ckpt output, DCP, DeepSpeed, safetensors).
        out: ``*.safetensors``, ``*.pt``/``*.bin``/``*.pth``, or a directory for the HF sharded
            layout (an existing one, or a ``str`` ending in ``/``); any other path is refused.
        format: the output format by name (``safetensors``, ``hf-sharded``, ``torch``), for a
            path that does not say.
        max_shard_size: shard limit for the directory layout (``5GB``, ``500MB``, …; default 5GB);
            refused for a one-file output.
        dtype: cast floating tensors to ``bfloat16``/``float16``/``float32``/``float64``.
        keep_prefix: keep the ``model.`` prefix of a DCP ``{"model": …}`` checkpoint.
        include, exclude: glob patterns on the source keys.
        state_key, inert_globals: for a single-file source, as for :func:`~ema_ckpt.accumulate`.
        overwrite: replace an existing output.
        workers: write the shards of a directory output in N processes (a single-file
            output is written by one of them).

    Example:
        >>> consolidate("ckpts/ema", "ema.safetensors").files   # doctest: +SKIP
        [('ema.safetensors', 3145816)]
    """
    directory = ends_in_separator(out)  # "hf/": said before Path(out) drops the "/"
    given = dict(locals())
    del given["on_progress"], given["directory"]
    args = command_options(given) | {"src": as_path(src)}
    args["format"] = choose_output_format(args["out"], format, directory=directory).name
    options = ConsolidateOptions(**args)
    check_not_overlapping(options.src, options.out)
    return run_job(ConsolidateJob(options), on_progress=on_progress)


@dataclass
class ConsolidateJob(Job[None, ConsolidateResult, ConsolidateResult]):
    """:func:`consolidate` as a job of the runner (:mod:`ema_ckpt.jobs`)."""

    options: ConsolidateOptions

    def lock_path(self) -> Location:
        return self.options.out

    def plan(self, notes: list[str]) -> None:
        return None

    def targets(self, plan: None) -> list[Target]:
        fmt = output_format(self.options.format)
        return [Target(self.options.out, single_file=fmt.single_file, replace=self.options.overwrite)]

    def compute(self, plan: None, context: JobContext) -> ConsolidateResult:
        """What was written, but for the files, counted on disk once they are published."""
        opts = self.options

        def open_source() -> tuple[Any, list[str]]:
            [reader] = context.open_sources([opts.src])
            keys = select_keys(reader, opts.include, opts.exclude)
            if not keys:
                raise UsageError(f"{opts.src}: no tensor keys to write")
            return reader, keys

        reader, keys = context.check(open_source)
        names = output_names(reader, keys, keep_prefix=opts.keep_prefix)
        fmt = output_format(opts.format)
        stored = reader.stored()
        tensors = [OutputTensor(k, names[k], as_tuple(stored[k][0]),
                                opts.dtype if opts.dtype is not None and is_float(stored[k][1]) else stored[k][1],
                                stored[k][1]) for k in keys]
        shard = parse_size(opts.max_shard_size if opts.max_shard_size is not None else DEFAULT_MAX_SHARD_SIZE)
        settings: dict[str, Any] = {"max_shard_bytes": shard} if "max_shard_bytes" in fmt.settings else {}
        writer = context.writer(0, fmt.name, **settings)
        carry_into([writer], reader, opts.include, opts.exclude)
        written = context.write([reader], [OutputSpec("out", (Update(0, 1.0),), mode="copy")], [writer], tensors,
                                layout=reader, copy_source=0)
        prefix = None if opts.keep_prefix else container_prefix(reader, keys)
        index = next((f.name for f in written.files[0] if f.role == "index"), None)
        return ConsolidateResult(opts.out, opts.format, keys=len(keys), renamed_prefix=prefix, index=index,
                                 carried=[f.name for f in written.files[0] if f.role == "carried"])

    def result(self, plan: None, computed: ConsolidateResult | None, seconds: float) -> ConsolidateResult:
        assert computed is not None
        files = files_on_disk(self.options.out)
        result = replace(computed, files=files, bytes_written=sum(size for _, size in files), seconds=seconds)
        if computed.renamed_prefix:
            result.notes.append(Note(f"keys written without the DCP container level {computed.renamed_prefix!r} "
                                     "({keep_prefix=True} keeps it)", mentions=("keep_prefix",)))
        return result


__all__ = ["ConsolidateJob", "ConsolidateOptions", "ConsolidateResult", "consolidate", "parse_size"]
