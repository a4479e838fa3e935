"""``posthoc`` and ``average``: weighted sums of checkpoints, planned first, then streamed.

A run is a :class:`~ema_ckpt.plans.Plan` (outputs × terms), computed from steps and manifests
alone; ``dry_run=True`` returns it without reading a tensor. Executing it reads each input
region once and adds it into every output, so a sweep of K profiles costs one pass over the
inputs.

Each output is a directory with its manifest (``ema-ckpt.json``): a DCP checkpoint, or
(``format="safetensors"``) one ``model.safetensors`` file named as ``consolidate`` names it.

Example:
    >>> posthoc("ckpts/", out="posthoc/", sigma_rels=["0.05", "0.10"])   # doctest: +SKIP
    >>> posthoc("ckpts/", out="sweep/", sigma_rels=["0.05"], format="safetensors")  # doctest: +SKIP
    >>> average("ckpts/", out="avg/", last=5)                               # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from ..discovery import checkpoint_paths
from ..dtypes import ACCUMULATE_DTYPES
from ..engine import check_device
from ..errors import OptionError, UsageError
from ..formats.options import read_options_from
from ..jobs import run_job
from ..plans import Plan, PlannedOutput, SnapshotInput, Term, find_snapshots, plan_average, plan_posthoc
from ..profile_specs import parse_weights
from ..progress import Progress
from ..storage import Location, as_path, is_location, output_location, output_path
from ..sums import SAFETENSORS_FILE, SUM_FORMATS, RunResult, SumJob, SumPlan, default_format
from ..writers.base import check_directory_output

_RUNTIME = {"recorded": False}


@dataclass(frozen=True, slots=True)
class PosthocOptions:
    """Everything a :func:`posthoc` run needs; checked when made."""

    checkpoints: tuple[Location, ...]
    out: Location = field(metadata=_RUNTIME)
    sigma_rels: tuple[str, ...] = ()
    gammas: tuple[str, ...] = ()
    at_step: int | None = None
    step_regex: str | None = None
    step_from: str | None = None
    component: str | None = None
    skip: tuple[Location, ...] = ()
    dtype: str = "float32"
    format: str | None = None
    keep_prefix: bool = False
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    average_buffers: bool = False
    state_key: str | None = None
    inert_globals: tuple[str, ...] = field(default=(), metadata=_RUNTIME)
    dry_run: bool = field(default=False, metadata=_RUNTIME)
    overwrite: bool = field(default=False, metadata=_RUNTIME)
    wait_seconds: float = field(default=0.0, metadata=_RUNTIME)
    workers: int = field(default=1, metadata=_RUNTIME)
    device: str = field(default="cpu", metadata=_RUNTIME)

    def __post_init__(self) -> None:
        check_run_fields(self)
        if not self.sigma_rels and not self.gammas:
            raise UsageError("give at least one {sigma_rels} or {gammas}", mentions=("sigma_rels", "gammas"))

    @property
    def single_output(self) -> bool:
        return False

    def make_plan(self) -> Plan:
        return plan_posthoc(self.checkpoints, sigma_rels=self.sigma_rels, gammas=self.gammas, at_step=self.at_step,
                            step_regex=self.step_regex, exclude_paths=[self.out], skip=self.skip,
                            step_from=self.step_from, component=self.component)


@dataclass(frozen=True, slots=True)
class AverageOptions:
    """Everything an :func:`average` run needs; checked when made."""

    checkpoints: tuple[Location, ...]
    out: Location = field(metadata=_RUNTIME)
    last: int | None = None
    from_step: int | None = None
    to_step: int | None = None
    every: int | None = None
    weights: str | None = None
    step_regex: str | None = None
    step_from: str | None = None
    component: str | None = None
    skip: tuple[Location, ...] = ()
    dtype: str = "float32"
    format: str | None = None
    keep_prefix: bool = False
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    average_buffers: bool = False
    state_key: str | None = None
    inert_globals: tuple[str, ...] = field(default=(), metadata=_RUNTIME)
    dry_run: bool = field(default=False, metadata=_RUNTIME)
    overwrite: bool = field(default=False, metadata=_RUNTIME)
    wait_seconds: float = field(default=0.0, metadata=_RUNTIME)
    workers: int = field(default=1, metadata=_RUNTIME)
    device: str = field(default="cpu", metadata=_RUNTIME)

    def __post_init__(self) -> None:
        check_run_fields(self)
        if self.last is None and self.from_step is None and self.to_step is None:
            raise UsageError("choose the checkpoints: {last=K}, or {from_step=A} and/or {to_step=B}",
                             mentions=("last", "from_step", "to_step"))
        parse_weights(self.weights)  # a malformed schedule is refused before anything is read

    @property
    def single_output(self) -> bool:
        return True

    def make_plan(self) -> Plan:
        return plan_average(self.checkpoints, last=self.last, from_step=self.from_step, to_step=self.to_step,
                            every=self.every, weights=self.weights, step_regex=self.step_regex,
                            exclude_paths=[self.out], skip=self.skip, step_from=self.step_from,
                            component=self.component)


def check_run_fields(options: Any) -> None:
    """Check and normalise the fields every weighted-sum command shares (in place, on a frozen dataclass)."""
    set_ = object.__setattr__
    set_(options, "inert_globals", read_options_from(options).inert_globals)
    set_(options, "checkpoints", tuple(checkpoint_paths(options.checkpoints)))
    if options.format is not None and options.format not in SUM_FORMATS:
        raise OptionError("format", f"must be one of {', '.join(SUM_FORMATS)}, got {options.format!r}",
                          value=options.format)
    check_directory_output(options.out, "dcp" if options.format in (None, "hf") else options.format)
    set_(options, "out", output_path(options.out))
    for name in ("include", "exclude"):
        set_(options, name, tuple(getattr(options, name)))
    set_(options, "skip", tuple(as_path(p) for p in options.skip))
    if options.dtype not in ACCUMULATE_DTYPES:
        raise OptionError("dtype", f"must be one of {', '.join(ACCUMULATE_DTYPES)}, got {options.dtype!r}",
                          value=options.dtype)
    check_device(options.device)


@overload
def posthoc(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location,
            dry_run: Literal[False] = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> RunResult: ...
@overload
def posthoc(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: Literal[True],
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan: ...
@overload
def posthoc(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: bool = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan | RunResult: ...


def posthoc(
    checkpoints: str | Location | Sequence[str | Location],
    *,
    out: str | Location,
    dry_run: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    **options: Any,
) -> Plan | RunResult:
    """Post-hoc power-function EMAs (EDM2), one per value, at ``out/sigma_rel_<value>``.

    Each output is a directory with its manifest: a DCP checkpoint, or (``format="safetensors"``)
    ``model.safetensors``, its keys named as :func:`~ema_ckpt.consolidate` names them.

    Args:
        checkpoints: a folder of raw checkpoints, or of the snapshots ``accumulate(snapshot_every=…)`` keeps.
        out: parent directory of the outputs.
        dry_run: return the :class:`~ema_ckpt.plans.Plan` (coefficients) and read no tensor.
        on_progress: called after each region.
        **options: the fields of :class:`PosthocOptions`: ``sigma_rels``, ``gammas`` (the
            profiles as typed: ``"0.05"``, ``"0.05:0.2:0.05"``), ``at_step`` (T, default the
            newest checkpoint), ``step_regex``, ``step_from``, ``component``, ``skip``, ``dtype``,
            ``format`` (``dcp`` or ``safetensors``; default: safetensors for safetensors inputs, else
            dcp), ``keep_prefix`` (keep the ``model.`` of a DCP ``{"model": …}`` save and a wrapper's
            prefix), ``include``,
            ``exclude``, ``state_key`` and ``inert_globals`` (single-file checkpoints: as for
            :func:`~ema_ckpt.accumulate`), ``overwrite``, ``wait_seconds``, ``workers``, ``device``.

    Example:
        >>> plan = posthoc("ckpts", out="posthoc", sigma_rels=["0.05", "0.1"], dry_run=True)  # doctest: +SKIP
        >>> [round(sum(t.coefficient for t in o.terms), 12) for o in plan.outputs]              # doctest: +SKIP
        [1.0, 1.0]
    """
    opts = PosthocOptions(_paths(checkpoints), output_location(out), dry_run=dry_run, **_tuples(options))
    return run_job(SumJob(opts), on_progress=on_progress)


@overload
def average(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location,
            dry_run: Literal[False] = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> RunResult: ...
@overload
def average(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: Literal[True],
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan: ...
@overload
def average(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, dry_run: bool = ...,
            on_progress: Callable[[Progress], None] | None = ..., **options: Any) -> Plan | RunResult: ...


def average(
    checkpoints: str | Location | Sequence[str | Location],
    *,
    out: str | Location,
    dry_run: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    **options: Any,
) -> Plan | RunResult:
    """Average of the selected checkpoints into ``out`` (one directory, as :func:`posthoc` writes);
    uniform unless ``weights`` names a schedule.

    Args:
        checkpoints: a folder of checkpoints, or a list of them.
        out: the output directory.
        dry_run: return the :class:`~ema_ckpt.plans.Plan` and read no tensor.
        **options: the fields of :class:`AverageOptions`: ``last`` (the newest K), or
            ``from_step``/``to_step``; ``every`` (every n-th checkpoint, counted back from the
            newest); ``weights`` (``uniform``, ``linear``, ``minus-sqrt``, ``cosine``, or a CSV
            file of ``step,learning_rate`` rows: a decay schedule as merge weights, WSM); and as
            for :func:`posthoc`.

    Example:
        >>> average("ckpts", out="avg", last=5)  # doctest: +SKIP
        >>> average("ckpts", out="avg", last=8, weights="minus-sqrt")  # doctest: +SKIP
    """
    opts = AverageOptions(_paths(checkpoints), output_location(out), dry_run=dry_run, **_tuples(options))
    return run_job(SumJob(opts), on_progress=on_progress)


def _paths(checkpoints: str | Location | Sequence[str | Location]) -> tuple[Location, ...]:
    if isinstance(checkpoints, str) or is_location(checkpoints):
        return (as_path(checkpoints),)
    return tuple(as_path(p) for p in checkpoints)


def _tuples(options: dict[str, Any]) -> dict[str, Any]:
    unknown = set(options) - set(PosthocOptions.__dataclass_fields__) - set(AverageOptions.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unexpected option{'s' if len(unknown) > 1 else ''}: {', '.join(sorted(unknown))}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


__all__ = ["SAFETENSORS_FILE", "SUM_FORMATS", "AverageOptions", "Plan", "PlannedOutput", "PosthocOptions", "RunResult",
           "SnapshotInput", "SumJob", "SumPlan", "Term", "average", "default_format", "find_snapshots", "posthoc"]
