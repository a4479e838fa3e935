"""Plans: outputs × terms (checkpoint, coefficient), from steps and manifests alone.

A :class:`Plan` is what ``posthoc``, ``average`` and ``accumulate`` compute before reading a
tensor (a dry run shows it), the coefficients from :mod:`ema_ckpt.maths`.

Example:
    >>> import tempfile, numpy as np; from pathlib import Path; from safetensors.numpy import save_file
    >>> ckpts = Path(tempfile.mkdtemp())
    >>> for step in (100, 200, 300, 400):
    ...     save_file({"w": np.full(2, step, np.float32)}, ckpts / f"step_{step}.safetensors")
    >>> plan = plan_posthoc(ckpts, sigma_rels=["0.05", "0.10"])
    >>> [o.name for o in plan.outputs]
    ['sigma_rel_0.05', 'sigma_rel_0.10']
    >>> [(t.step, round(t.coefficient, 3)) for t in plan.outputs[1].terms]
    [(100, 0.0), (200, 0.004), (300, 0.098), (400, 0.898)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import maths, profile_specs
from .discovery import FoundCheckpoint, checkpoint_paths, discover
from .errors import Note, UsageError
from .formats.options import DEFAULT_READ, ReadOptions
from .manifest import MANIFEST_NAME, Manifest
from .profile_specs import MergeWeights
from .storage import Location

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
    """Caveats: :class:`~ema_ckpt.errors.Note` strings where they name a parameter."""
    stats: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        terms = [{"path": t.path, "step": t.step, **({} if t.sigma_rel is None else {"sigma_rel": t.sigma_rel}),
                  "coefficient": t.coefficient} for t in self.terms]
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
    """A power-EMA snapshot written by ``accumulate(snapshot_every=…)``."""

    path: Location
    step: int
    gamma: float
    sigma_rel: float


def find_snapshots(paths: Sequence[Location]) -> list[SnapshotInput]:
    """Snapshot directories in ``paths`` (or their ``snapshots/`` folders), sorted by step and γ."""
    found: list[SnapshotInput] = []
    for root in paths:
        for folder in (root, root / "snapshots"):
            if not folder.is_dir():
                continue
            children: list[Location] = list(folder.iterdir())
            for child in sorted(children, key=str):
                if child.name.startswith("."):  # staging directories of an interrupted run
                    continue
                manifest = Manifest.read(child) if (child / MANIFEST_NAME).is_file() else None
                if manifest is not None and manifest.kind == SNAPSHOT_KIND:
                    gamma = float(manifest.profile["gamma"])
                    found.append(SnapshotInput(child, manifest.step, gamma, maths.gamma_to_sigma_rel(gamma)))
    found.sort(key=lambda s: (s.step, s.gamma))
    return found


def power_targets(sigma_rels: Sequence[str], gammas: Sequence[str]) -> list[tuple[str, float, float]]:
    """(output name, γ, σ_rel) for each requested profile, names as typed."""
    if not sigma_rels and not gammas:
        raise UsageError("give at least one {sigma_rels} or {gammas}", mentions=("sigma_rels", "gammas"))
    return [(name, gamma, maths.gamma_to_sigma_rel(gamma))
            for name, gamma, _typed in profile_specs.power_profiles(sigma_rels, gammas)]


# how a power EMA and a classic one are made longer, for sparse_warning
POWER_LONGER = Note("a larger {sigma_rels}", mentions=("sigma_rels",))
EXPONENTIAL_LONGER = Note("a longer {half_life}, or a {decay} closer to 1", mentions=("half_life", "decay"))


def sparse_warning(steps: Sequence[int], window: float, longer: Note) -> Note | None:
    """The plain-words warning for checkpoints too sparse for an EMA's window (what goes wrong,
    and what to do: save more often, or ``longer``), or None.

    Example:
        >>> print(sparse_warning([100, 200, 300], 1000.0, POWER_LONGER))
        this EMA averages over about the last 1,000 steps, but checkpoints are up to 100 steps apart (between \
steps 100 and 200), so only 3 checkpoints fall in that span: the result is an average of those few checkpoints \
and keeps more of the training noise than an EMA of every step would (a relative error of about 32%); save \
checkpoints more often (at least every 50 steps), or choose a longer EMA (a larger sigma_rels)
    """
    sparse = maths.sparse_checkpoints(steps, window)
    if sparse is None:
        return None
    count = f"only {sparse.in_window} checkpoint{' falls' if sparse.in_window == 1 else 's fall'}"
    every = math.floor(sparse.window / 20 * (1 + 1e-9))  # the spacing the planner accepts (999.99…/20: 50)
    often = f"at least every {every:,} steps" if every > 1 else "every step"
    # past 100% the estimate means little
    error = f"of about {100 * sparse.rel_error:.0f}%" if sparse.rel_error < 1 else "over 100%"
    return Note.joined("", [
        f"this EMA averages over about the last {max(sparse.window, 1):,.0f} steps, but checkpoints are up to "
        f"{sparse.gap:,} steps apart (between steps {sparse.after:,} and {sparse.before:,}), so {count} in that "
        f"span: the result is an average of those few checkpoints and keeps more of the training noise than an "
        f"EMA of every step would (a relative error {error}); save checkpoints more "
        f"often ({often}), or choose a longer EMA (", longer, ")"])


def plan_posthoc(
    checkpoints: str | Location | Sequence[str | Location],
    *,
    sigma_rels: Sequence[str] = (),
    gammas: Sequence[str] = (),
    at_step: int | None = None,
    step_regex: str | None = None,
    exclude_paths: Sequence[Location] = (),
    skip: Sequence[str | Location] = (),
    step_from: str | None = None,
    component: str | None = None,
    read: ReadOptions = DEFAULT_READ,
) -> Plan:
    """Coefficients of each requested power-function EMA at T (the newest step, or ``at_step``):
    the closed form from raw checkpoints, EDM2's least-squares fit from snapshots."""
    paths = checkpoint_paths(checkpoints)
    targets = power_targets(sigma_rels, gammas)
    snapshots = find_snapshots(paths)
    if snapshots:
        return plan_from_snapshots(snapshots, targets, at_step)
    found = discover(paths, step_regex=step_regex, step_from=step_from, component=component, exclude=exclude_paths,
                     skip=skip, read=read)
    return Plan("posthoc", found.checkpoints, power_outputs(found.checkpoints, targets, at_step), found.notes)


def power_outputs(checkpoints: Sequence[FoundCheckpoint], targets: Sequence[tuple[str, float, float]],
                  at_step: int | None = None) -> list[PlannedOutput]:
    """One planned output per (name, γ, σ_rel) target: the power EMA of raw ``checkpoints`` (oldest first)."""
    steps = [c.step for c in checkpoints]
    outputs = []
    for name, gamma, sigma_rel in targets:
        coeffs = maths.power_coefficients(steps, gamma, at_step)
        big_t = max(s for s in steps if at_step is None or s <= at_step)
        terms = [Term(str(c.path), c.step, coeffs[i]) for i, c in enumerate(checkpoints) if c.step <= big_t]
        warning = sparse_warning([t.step for t in terms], maths.power_window(gamma, big_t), POWER_LONGER)
        warnings: list[str] = [warning] if warning else []
        if at_step is not None and big_t != at_step:
            warnings.append(Note(f"no checkpoint at {{at_step={at_step}}}: the EMA ends at step {big_t}, "
                                 "the newest checkpoint before it", mentions=("at_step",)))
        outputs.append(PlannedOutput(
            name, big_t, terms, sigma_rel=sigma_rel, gamma=gamma,
            profile={"kind": "power", "sigma_rel": sigma_rel, "gamma": gamma},
            warnings=warnings,
            stats=_stats(terms),
        ))
    return outputs


def plan_from_snapshots(snapshots: list[SnapshotInput], targets: list[tuple[str, float, float]],
                         at_step: int | None) -> Plan:
    inputs = [FoundCheckpoint(s.path, s.step, "dcp") for s in snapshots]
    specs = [maths.Snapshot(s.step, s.gamma) for s in snapshots]
    outputs = []
    for name, gamma, sigma_rel in targets:
        result = maths.posthoc_plan(specs, gamma, at_step)
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
    checkpoints: str | Location | Sequence[str | Location],
    *,
    last: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
    every: int | None = None,
    weights: str | MergeWeights | None = None,
    step_regex: str | None = None,
    exclude_paths: Sequence[Location] = (),
    skip: Sequence[str | Location] = (),
    step_from: str | None = None,
    component: str | None = None,
    read: ReadOptions = DEFAULT_READ,
) -> Plan:
    """An average of a selection of checkpoints: uniform (fairseq ``average_checkpoints``,
    LAWA with ``every``), or weighted by a decay schedule (``weights``: WSM, Megatron-LM
    ``weighted_merge``; :mod:`ema_ckpt.maths.merge_weights`)."""
    if last is None and from_step is None and to_step is None:
        raise UsageError("choose the checkpoints: {last=K}, or {from_step=A} and/or {to_step=B}",
                         mentions=("last", "from_step", "to_step"))
    found = discover(checkpoint_paths(checkpoints), step_regex=step_regex, step_from=step_from, component=component,
                     exclude=exclude_paths, skip=skip, read=read)
    output = average_output("average", found.checkpoints, last=last, from_step=from_step, to_step=to_step,
                            every=every, weights=weights)
    return Plan("average", found.checkpoints, [output], found.notes)


def average_output(name: str, checkpoints: Sequence[FoundCheckpoint], *, last: int | None = None,
                   from_step: int | None = None, to_step: int | None = None, every: int | None = None,
                   weights: str | MergeWeights | None = None) -> PlannedOutput:
    """The planned output ``name``: an average of a selection of ``checkpoints`` (oldest first)."""
    spec = weights if isinstance(weights, MergeWeights) else profile_specs.parse_weights(weights)
    steps = [c.step for c in checkpoints]
    picked = maths.uniform_selection(steps, last=last, from_step=from_step, to_step=to_step, every=every)
    coeffs = spec.coefficients([steps[i] for i in picked])
    terms = [Term(str(checkpoints[i].path), steps[i], w) for i, w in zip(picked, coeffs, strict=True) if w != 0.0]
    profile: dict[str, Any] = {"kind": "uniform" if spec.name == "uniform" else "weighted", "last": last,
                               "from_step": from_step, "to_step": to_step}
    if every is not None:
        profile["every"] = every
    if spec.name != "uniform":
        profile.update(spec.to_json())
    return PlannedOutput(name, steps[picked[-1]], terms, profile=profile, stats=_stats(terms))


def _stats(terms: Sequence[Term]) -> dict[str, float | None]:
    s = maths.describe_plan([t.step for t in terms], [t.coefficient for t in terms])
    return {"sigma_rel": s.sigma_rel, "mean_age": s.mean_age, "n_eff": s.n_eff, "max_abs": s.max_abs}
