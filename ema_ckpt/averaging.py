"""``posthoc`` and ``average``: weighted sums of checkpoints, planned first, then streamed.

A run is a :class:`Plan`: outputs × terms (checkpoint, coefficient), computed by the pure
planner (:mod:`ema_ckpt.planner`) from steps and manifests alone. ``dry_run=True`` returns the
plan without reading a tensor. Executing it reads each input region once and adds it into
every output, so a sweep of K profiles costs one pass over the inputs.

Inputs are raw checkpoints (power-function EMA in closed form, EDM2 eq. for
cᵢ = (tᵢ/T)^(γ+1) − (tᵢ₋₁/T)^(γ+1)) or the power-EMA snapshots that ``accumulate
--sigma-rel … --snapshot-every K`` keeps (EDM2's least-squares reconstruction).

Example:
    >>> plan = plan_posthoc("ckpts/", sigma_rels=["0.05", "0.10"])        # doctest: +SKIP
    >>> [o.name for o in plan.outputs]                                       # doctest: +SKIP
    ['sigma_rel_0.05', 'sigma_rel_0.10']
    >>> run_plan(plan, out="posthoc/")                                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from . import planner
from .discovery import FoundCheckpoint, checkpoint_paths, discover
from .dist import current_workers, in_worker_group, run_workers
from .dtypes import torch_dtype
from .engine import OutputSpec, Progress, Update, check_device, layout_regions
from .execute import open_checkpoints, write_dcp_outputs
from .errors import UsageError
from .formats.base import CheckpointReader
from .fs import OutputLock, discard_on_error, new_staging_dir, output_path, publish, recover
from .manifest import MANIFEST_NAME, FoldedCheckpoint, Manifest, fingerprint
from .selection import check_compatible, select_keys

ACCUMULATE_DTYPES = ("float32", "float64")
SNAPSHOT_KIND = "snapshot"


@dataclass(frozen=True, slots=True)
class Term:
    """One input's share of an output."""

    path: str
    step: int
    coefficient: float
    sigma_rel: float | None = None  # snapshot inputs only


@dataclass(slots=True)
class PlannedOutput:
    """One output of a plan: its name, profile, time T and terms."""

    name: str
    step: int
    terms: list[Term]
    sigma_rel: float | None = None
    gamma: float | None = None
    profile: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    stats: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        terms = []
        for t in self.terms:
            item: dict[str, Any] = {"path": t.path, "step": t.step}
            if t.sigma_rel is not None:
                item["sigma_rel"] = t.sigma_rel
            item["coefficient"] = t.coefficient
            terms.append(item)
        return {"name": self.name, "sigma_rel": self.sigma_rel, "gamma": self.gamma, "step": self.step,
                "terms": terms, "warnings": list(self.warnings)}


@dataclass(slots=True)
class Plan:
    """Outputs × terms over a list of inputs; nothing read but metadata."""

    kind: str
    inputs: list[FoundCheckpoint]
    outputs: list[PlannedOutput]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"outputs": [o.to_json() for o in self.outputs], "notes": list(self.notes)}


@dataclass(frozen=True, slots=True)
class SnapshotInput:
    """A power-EMA snapshot written by ``accumulate --snapshot-every``."""

    path: Path
    step: int
    gamma: float
    sigma_rel: float


def find_snapshots(paths: Sequence[Path]) -> list[SnapshotInput]:
    """Snapshot directories in ``paths`` (or their ``snapshots/`` folders), sorted by step and γ."""
    found: list[SnapshotInput] = []
    for root in paths:
        for folder in (root, root / "snapshots"):
            if not folder.is_dir():
                continue
            for child in sorted(folder.iterdir()):
                if child.name.startswith("."):  # staging directories of an interrupted run
                    continue
                manifest = Manifest.read(child) if (child / MANIFEST_NAME).is_file() else None
                if manifest is not None and manifest.kind == SNAPSHOT_KIND:
                    gamma = float(manifest.profile["gamma"])
                    found.append(SnapshotInput(child, manifest.step, gamma, planner.gamma_to_sigma_rel(gamma)))
    found.sort(key=lambda s: (s.step, s.gamma))
    return found


def _targets(sigma_rels: Sequence[str], gammas: Sequence[str]) -> list[tuple[str, float, float]]:
    """(output name, γ, σ_rel) for each requested profile, names as typed."""
    targets: list[tuple[str, float, float]] = []
    for text in sigma_rels:
        for typed, value in planner.parse_sigma_list(text):
            targets.append((f"sigma_rel_{typed}", planner.sigma_rel_to_gamma(value), value))
    for text in gammas:
        for item in text.split(","):
            item = item.strip()
            gamma = planner.check_gamma(item)
            targets.append((f"gamma_{item}", gamma, planner.gamma_to_sigma_rel(gamma)))
    if not targets:
        raise UsageError("give at least one --sigma-rel or --gamma")
    names = [t[0] for t in targets]
    if len(set(names)) != len(names):
        raise UsageError("the same profile is requested twice")
    return targets


def plan_posthoc(
    checkpoints: str | Path | Sequence[str | Path],
    *,
    sigma_rels: Sequence[str] = (),
    gammas: Sequence[str] = (),
    at_step: int | None = None,
    step_regex: str | None = None,
    exclude_paths: Sequence[Path] = (),
    skip: Sequence[str | Path] = (),
) -> Plan:
    """Coefficients of each requested power-function EMA at T (the newest step, or ``at_step``).

    From raw checkpoints: the closed form cᵢ = (tᵢ/T)^(γ+1) − (tᵢ₋₁/T)^(γ+1), t₀ = 0. From
    snapshots: EDM2's least-squares fit of the target profile by the snapshots' profiles.
    """
    paths = checkpoint_paths(checkpoints)
    targets = _targets(sigma_rels, gammas)
    snapshots = find_snapshots(paths)
    if snapshots:
        return _plan_from_snapshots(snapshots, targets, at_step)
    found = discover(paths, step_regex=step_regex, exclude=exclude_paths, skip=skip)
    steps = [c.step for c in found.checkpoints]
    outputs = []
    for name, gamma, sigma_rel in targets:
        coeffs = planner.power_coefficients(steps, gamma, at_step)
        big_t = max(s for s in steps if at_step is None or s <= at_step)
        used = [i for i, s in enumerate(steps) if s <= big_t]
        terms = [Term(str(found.checkpoints[i].path), steps[i], coeffs[i]) for i in used]
        warning = planner.spacing_warning([t.step for t in terms], planner.power_window(gamma, big_t))
        warnings = [warning] if warning else []
        if at_step is not None and big_t != at_step:
            warnings.append(f"no checkpoint at --at-step {at_step}: the EMA ends at step {big_t}, "
                            "the newest checkpoint before it")
        outputs.append(PlannedOutput(
            name, big_t, terms, sigma_rel=sigma_rel, gamma=gamma,
            profile={"kind": "power", "sigma_rel": sigma_rel, "gamma": gamma},
            warnings=warnings,
            stats=_stats([t.step for t in terms], [t.coefficient for t in terms]),
        ))
    return Plan("posthoc", found.checkpoints, outputs, found.notes)


def _plan_from_snapshots(snapshots: list[SnapshotInput], targets, at_step: int | None) -> Plan:
    inputs = [FoundCheckpoint(s.path, s.step, "dcp") for s in snapshots]
    specs = [planner.Snapshot(s.step, s.gamma) for s in snapshots]
    outputs = []
    for name, gamma, sigma_rel in targets:
        result = planner.posthoc_plan(specs, gamma, at_step)
        terms = [Term(str(snapshots[i].path), snapshots[i].step, result.coefficients[i], snapshots[i].sigma_rel)
                 for i in result.used]
        outputs.append(PlannedOutput(
            name, result.at_step, terms, sigma_rel=sigma_rel, gamma=gamma,
            profile={"kind": "power", "sigma_rel": sigma_rel, "gamma": gamma, "from": "snapshots"},
            warnings=list(result.warnings),
            stats={"sigma_rel": result.sigma_rel, "mean_age": result.mean_age, "condition": result.condition,
                   "rel_error": result.rel_error, "max_abs": max(abs(t.coefficient) for t in terms)},
        ))
    return Plan("posthoc", inputs, outputs)


def plan_average(
    checkpoints: str | Path | Sequence[str | Path],
    *,
    last: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
    step_regex: str | None = None,
    exclude_paths: Sequence[Path] = (),
    skip: Sequence[str | Path] = (),
) -> Plan:
    """Uniform average (fairseq ``average_checkpoints``, LAWA) of a selection of checkpoints."""
    if last is None and from_step is None and to_step is None:
        raise UsageError("choose the checkpoints: --last K, or --from-step A and/or --to-step B")
    found = discover(checkpoint_paths(checkpoints), step_regex=step_regex, exclude=exclude_paths, skip=skip)
    steps = [c.step for c in found.checkpoints]
    coeffs = planner.uniform_coefficients(steps, last=last, from_step=from_step, to_step=to_step)
    terms = [Term(str(c.path), c.step, w) for c, w in zip(found.checkpoints, coeffs, strict=True) if w != 0.0]
    output = PlannedOutput(
        "average", terms[-1].step, terms,
        profile={"kind": "uniform", "last": last, "from_step": from_step, "to_step": to_step},
        stats=_stats([t.step for t in terms], [t.coefficient for t in terms]),
    )
    return Plan("average", found.checkpoints, [output], found.notes)


def _stats(steps: list[int], coeffs: list[float]) -> dict[str, float | None]:
    s = planner.describe_plan(steps, coeffs)
    return {"sigma_rel": s.sigma_rel, "mean_age": s.mean_age, "n_eff": s.n_eff, "max_abs": s.max_abs}


@dataclass(slots=True)
class RunResult:
    """What :func:`run_plan` wrote."""

    plan: Plan
    outputs: list[Path]
    bytes_read: int
    bytes_written: int
    seconds: float


def run_plan(
    plan: Plan,
    *,
    out: str | Path,
    single_output: bool = False,
    dtype: str = "float32",
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    overwrite: bool = False,
    wait_seconds: float = 0.0,
    device: str = "cpu",
    on_progress: Callable[[Progress], None] | None = None,
) -> RunResult:
    """Stream the plan: each input region read once, added into every output, written out.

    Outputs go to ``out/<name>`` (or ``out`` itself when ``single_output``), each a DCP
    checkpoint with a manifest, published atomically. Under a worker group every rank runs
    this with the same plan; each writes its share of the files.
    """
    started = time.perf_counter()
    if dtype not in ACCUMULATE_DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(ACCUMULATE_DTYPES)}, got {dtype!r}")
    check_device(device)
    group = current_workers(device)
    out = output_path(out)
    finals = [out] if single_output else [out / o.name for o in plan.outputs]
    steps = {str(c.path): c.step for c in plan.inputs}
    # (step, path): snapshots of several profiles share a step, and the order of the sum must
    # not depend on set order (string hashing differs per process) or the bits would
    used = sorted({t.path for o in plan.outputs for t in o.terms}, key=lambda p: (steps[p], p))
    index = {p: i for i, p in enumerate(used)}
    with contextlib.ExitStack() as stack:

        def prepare() -> list[Path]:
            stack.enter_context(OutputLock(out, wait_seconds=wait_seconds))
            if not single_output:
                recover(out)
            for final in finals:
                recover(final)
                if final.exists() and not overwrite:
                    raise UsageError(f"{final} exists; pass --overwrite to replace it")
            return [new_staging_dir(final, near=None if single_output else out) for final in finals]

        stagings = group.broadcast(group.run(prepare if group.is_coordinator else lambda: None))
        with discard_on_error(stagings, owner=group.is_coordinator):

            readers = open_checkpoints(group, used, stack)

            def check_all() -> tuple[list[CheckpointReader], list[str]]:
                keys = select_keys(readers[-1], include, exclude)
                if not keys:
                    raise UsageError(f"{readers[-1].path}: no tensor keys left after --include/--exclude")
                check_compatible(readers, keys, reference=len(readers) - 1, include=include, exclude=exclude)
                return readers, keys

            readers, keys = group.run(check_all)
            newest = readers[-1]
            specs_out = [
                OutputSpec(o.name, tuple(Update(index[t.path], t.coefficient) for t in
                                         sorted(o.terms, key=lambda t: index[t.path])), mode="sum")
                for o in plan.outputs
            ]
            written = write_dcp_outputs(
                group, readers, specs_out, stagings, layout_regions(newest, keys), newest.specs(),
                copy_source=len(readers) - 1, accumulate_dtype=torch_dtype(dtype),
                planner_data=getattr(newest, "planner_data", None), on_progress=on_progress, device=device,
                check_finite=range(len(readers)),
            )

            def publish_all() -> None:
                for output, files, staging in zip(plan.outputs, written.files, stagings, strict=True):
                    Manifest(
                        kind=plan.kind, profile=output.profile, dtype=dtype, step=output.step,
                        source_format=newest.format_name,
                        checkpoints=[FoldedCheckpoint(str(Path(t.path).resolve()), t.step,
                                                      fingerprint(Path(t.path))) for t in output.terms],
                        selection={"include": list(include), "exclude": list(exclude)},
                        files={f.name: {"size": f.size, "crc32": f.crc32} for f in files},
                        terms=[{"path": str(Path(t.path).resolve()), "step": t.step, "coefficient": t.coefficient}
                               for t in output.terms],
                        warnings=list(output.warnings),
                    ).write(staging)
                for staging, final in zip(stagings, finals, strict=True):
                    publish(staging, final)

            group.run(publish_all if group.is_coordinator else lambda: None)
    return RunResult(plan, finals, written.bytes_read, written.bytes_written, time.perf_counter() - started)


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How a plan is run: the options :func:`posthoc` and :func:`average` share."""

    dtype: str = "float32"
    include: Sequence[str] = ()
    exclude: Sequence[str] = ()
    overwrite: bool = False
    wait_seconds: float = 0.0
    device: str = "cpu"
    on_progress: Callable[[Progress], None] | None = None


@overload
def posthoc(checkpoints: str | Path | Sequence[str | Path], *, out: str | Path, sigma_rels: Sequence[str] = ...,
            gammas: Sequence[str] = ..., at_step: int | None = ..., dry_run: Literal[False] = ...,
            step_regex: str | None = ..., workers: int = ..., **options: Any) -> RunResult: ...
@overload
def posthoc(checkpoints: str | Path | Sequence[str | Path], *, out: str | Path, sigma_rels: Sequence[str] = ...,
            gammas: Sequence[str] = ..., at_step: int | None = ..., dry_run: Literal[True],
            step_regex: str | None = ..., workers: int = ..., **options: Any) -> Plan: ...
@overload
def posthoc(checkpoints: str | Path | Sequence[str | Path], *, out: str | Path, sigma_rels: Sequence[str] = ...,
            gammas: Sequence[str] = ..., at_step: int | None = ..., dry_run: bool = ...,
            step_regex: str | None = ..., workers: int = ..., **options: Any) -> Plan | RunResult: ...


def posthoc(
    checkpoints: str | Path | Sequence[str | Path],
    *,
    out: str | Path,
    sigma_rels: Sequence[str] = (),
    gammas: Sequence[str] = (),
    at_step: int | None = None,
    dry_run: bool = False,
    step_regex: str | None = None,
    workers: int = 1,
    skip: Sequence[str | Path] = (),
    **options: Any,
) -> Plan | RunResult:
    """Post-hoc power-function EMAs (EDM2), one per value, at ``out/sigma_rel_<value>``.

    Args:
        checkpoints: a folder of raw checkpoints, or of ``accumulate --snapshot-every`` snapshots.
        out: parent directory of the outputs.
        sigma_rels, gammas: the profiles, as typed (``"0.05"``, ``"0.05:0.2:0.05"``).
        at_step: T, the step the averages end at (default: the newest checkpoint).
        dry_run: return the :class:`Plan` (coefficients) and read no tensor.
        step_regex: how to read steps from directory names, when not a known pattern.
        workers: processes to share the work (output bytes do not depend on it).
        skip: checkpoints to leave out (each noted in the plan).
        **options: the fields of :class:`RunOptions` (``dtype``, ``include``, ``exclude``,
            ``overwrite``, ``wait_seconds``, ``device``, ``on_progress``).

    Example:
        >>> plan = posthoc("ckpts", out="posthoc", sigma_rels=["0.05", "0.1"], dry_run=True)  # doctest: +SKIP
        >>> [round(sum(t.coefficient for t in o.terms), 12) for o in plan.outputs]              # doctest: +SKIP
        [1.0, 1.0]
    """
    run = RunOptions(**options)
    if workers > 1 and not dry_run and not in_worker_group():
        return run_workers(workers, posthoc, checkpoints, out=out, sigma_rels=sigma_rels, gammas=gammas,
                           at_step=at_step, step_regex=step_regex, skip=skip,
                           local_kwargs={"on_progress": run.on_progress},
                           **_without_progress(run))
    plan = _coordinated(lambda: plan_posthoc(checkpoints, sigma_rels=sigma_rels, gammas=gammas, at_step=at_step,
                        step_regex=step_regex, exclude_paths=[Path(out)], skip=skip), run.device)
    return plan if dry_run else run_plan(plan, out=out, **_fields(run))


@overload
def average(checkpoints: str | Path | Sequence[str | Path], *, out: str | Path, last: int | None = ...,
            from_step: int | None = ..., to_step: int | None = ..., dry_run: Literal[False] = ...,
            step_regex: str | None = ..., workers: int = ..., **options: Any) -> RunResult: ...
@overload
def average(checkpoints: str | Path | Sequence[str | Path], *, out: str | Path, last: int | None = ...,
            from_step: int | None = ..., to_step: int | None = ..., dry_run: Literal[True],
            step_regex: str | None = ..., workers: int = ..., **options: Any) -> Plan: ...
@overload
def average(checkpoints: str | Path | Sequence[str | Path], *, out: str | Path, last: int | None = ...,
            from_step: int | None = ..., to_step: int | None = ..., dry_run: bool = ...,
            step_regex: str | None = ..., workers: int = ..., **options: Any) -> Plan | RunResult: ...


def average(
    checkpoints: str | Path | Sequence[str | Path],
    *,
    out: str | Path,
    last: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
    dry_run: bool = False,
    step_regex: str | None = None,
    workers: int = 1,
    skip: Sequence[str | Path] = (),
    **options: Any,
) -> Plan | RunResult:
    """Uniform average of the selected checkpoints into ``out`` (one DCP checkpoint).

    Args:
        checkpoints: a folder of checkpoints, or a list of them.
        out: the output directory.
        last: average the newest ``last`` checkpoints; or select by ``from_step``/``to_step``.
        dry_run: return the :class:`Plan` and read no tensor.
        step_regex, workers, skip, **options: as for :func:`posthoc`.

    Example:
        >>> average("ckpts", out="avg", last=5)  # doctest: +SKIP
    """
    run = RunOptions(**options)
    if workers > 1 and not dry_run and not in_worker_group():
        return run_workers(workers, average, checkpoints, out=out, last=last, from_step=from_step,
                           to_step=to_step, step_regex=step_regex, skip=skip,
                           local_kwargs={"on_progress": run.on_progress},
                           **_without_progress(run))
    plan = _coordinated(lambda: plan_average(checkpoints, last=last, from_step=from_step, to_step=to_step,
                                             step_regex=step_regex, exclude_paths=[Path(out)], skip=skip),
                        run.device)
    return plan if dry_run else run_plan(plan, out=out, single_output=True, **_fields(run))


def _fields(run: RunOptions) -> dict[str, Any]:
    return {name: getattr(run, name) for name in RunOptions.__dataclass_fields__}


def _without_progress(run: RunOptions) -> dict[str, Any]:
    """Options for spawned workers: a progress callback does not cross processes."""
    return {k: v for k, v in _fields(run).items() if k != "on_progress"}


def _coordinated(make_plan: Callable[[], Plan], device: str) -> Plan:
    """The coordinator's plan on every worker (inputs may change on disk while ranks start)."""
    if not in_worker_group():
        return make_plan()
    group = current_workers(device)
    return group.broadcast(group.run(make_plan if group.is_coordinator else lambda: None))
