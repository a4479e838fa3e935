"""The candidates ``select`` evaluates, planned from steps and manifests alone: one
:class:`~ema_ckpt.plans.Plan` whose outputs are the candidates, any mix of

* post-hoc power EMAs (``sigma_rels``/``gammas``; from snapshots when the paths hold them,
  else from the raw checkpoints: EDM2);
* averages of the newest K (``lasts``, spaced ``every`` apart: LAWA), uniform or weighted by
  each of ``weights`` (WSM, Megatron-LM ``weighted_merge``);
* classic EMAs an ``accumulate`` run wrote (``emas``), taken as they are;
* single checkpoints (``singles``: the newest K, or all), which a greedy soup also starts from.

Example:
    >>> import tempfile, numpy as np; from pathlib import Path; from safetensors.numpy import save_file
    >>> ckpts = Path(tempfile.mkdtemp())
    >>> for step in (100, 200, 300, 400):
    ...     save_file({"w": np.full(2, step, np.float32)}, ckpts / f"step_{step}.safetensors")
    >>> spec = CandidateSpec(sigma_rels=("0.05,0.1",), lasts=(4,), weights=("uniform", "minus-sqrt"))
    >>> [o.name for o in plan_candidates([ckpts], spec).outputs]
    ['sigma_rel_0.05', 'sigma_rel_0.1', 'last_4', 'minus-sqrt_last_4']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..discovery import FoundCheckpoint, checkpoint_paths, discover
from ..errors import CheckpointNotFoundError, UsageError
from ..formats.options import DEFAULT_READ, ReadOptions
from ..formats.resolve import detect_format
from ..manifest import MANIFEST_NAME, Manifest
from ..plans import (
    Plan,
    PlannedOutput,
    Term,
    average_output,
    find_snapshots,
    plan_from_snapshots,
    power_outputs,
    power_targets,
)
from ..profile_specs import parse_weights
from ..storage import Location, as_path

__all__ = ["ALL", "CandidateSpec", "plan_candidates"]

ALL = -1
"""``singles=ALL``: every checkpoint is a candidate on its own."""
_SAFE = re.compile(r"[^A-Za-z0-9_.=-]+")


@dataclass(frozen=True, slots=True)
class CandidateSpec:
    """Which candidates to plan (see the module docstring). Empty fields add none."""

    sigma_rels: tuple[str, ...] = ()
    gammas: tuple[str, ...] = ()
    lasts: tuple[int, ...] = ()
    every: int | None = None
    weights: tuple[str, ...] = ()
    emas: tuple[Location, ...] = ()
    singles: int | None = None
    at_step: int | None = None


def _label(name: str) -> str:
    return _SAFE.sub("_", name.removesuffix(".csv").removesuffix(".CSV")) or "weights"


def _average_name(weight: str, last: int, every: int | None) -> str:
    base = f"last_{last}" + (f"_every_{every}" if every and every > 1 else "")
    return base if weight == "uniform" else f"{weight}_{base}"


def plan_candidates(checkpoints: Sequence[str | Location], spec: CandidateSpec, *, step_regex: str | None = None,
                    exclude_paths: Sequence[Location] = (), skip: Sequence[str | Location] = (),
                    step_from: str | None = None, component: str | None = None,
                    read: ReadOptions = DEFAULT_READ) -> Plan:
    """Every candidate of ``spec`` as one output of a plan (kind ``select``), in the order given.

    Raises:
        UsageError: no candidate asked for, or two with one name.
    """
    if not (spec.sigma_rels or spec.gammas or spec.lasts or spec.emas or spec.singles):
        raise UsageError("give at least one candidate: {sigma_rels}, {lasts}, {emas} or {singles}",
                         mentions=("sigma_rels", "lasts", "emas", "singles"))
    paths = checkpoint_paths(checkpoints)
    outputs: list[PlannedOutput] = []
    notes: list[str] = []
    snapshots = find_snapshots(paths) if (spec.sigma_rels or spec.gammas) else []
    raw: list[FoundCheckpoint] = []
    if spec.lasts or spec.singles or ((spec.sigma_rels or spec.gammas) and not snapshots):
        found = discover(paths, step_regex=step_regex, step_from=step_from, component=component,
                         exclude=[*exclude_paths, *(s.path for s in snapshots)], skip=skip, read=read)
        raw, notes = list(found.checkpoints), list(found.notes)
    inputs = list(raw)
    if spec.sigma_rels or spec.gammas:
        targets = power_targets(spec.sigma_rels, spec.gammas)
        if snapshots:
            from_snapshots = plan_from_snapshots(snapshots, targets, spec.at_step)
            inputs.extend(from_snapshots.inputs)
            outputs.extend(from_snapshots.outputs)
        else:
            outputs.extend(power_outputs(raw, targets, spec.at_step))
    for k in spec.lasts:
        for weights in spec.weights or ("uniform",):
            name = _average_name(_label(parse_weights(weights).name), k, spec.every)
            if k > len(raw):
                notes.append(f"{name}: only {len(raw)} checkpoints; averaging all of them")
            outputs.append(average_output(name, raw, last=k, every=spec.every, weights=weights))
    for path in spec.emas:
        ema, ema_output = _classic_ema(as_path(path), many=len(spec.emas) > 1)
        inputs.append(ema)
        outputs.append(ema_output)
    if spec.singles:
        chosen = raw if spec.singles == ALL else raw[-spec.singles:]
        outputs.extend(PlannedOutput(f"step_{c.step}", c.step, [Term(str(c.path), c.step, 1.0)],
                                     profile={"kind": "single"}) for c in chosen)  # each checkpoint on its own
    _check_unique([o.name for o in outputs])
    return Plan("select", inputs, outputs, notes)


def _classic_ema(path: Location, *, many: bool) -> tuple[FoundCheckpoint, PlannedOutput]:
    """An ``accumulate`` output as a candidate, taken whole (its manifest gives the step)."""
    if not (path / MANIFEST_NAME).is_file():
        raise CheckpointNotFoundError(path, "is not an ema-ckpt output (no ema-ckpt.json): give the {out} of an "
                                            "accumulate run", mentions=("out",))
    manifest = Manifest.read(path)
    fmt = detect_format(path)
    if manifest is None or fmt is None:
        raise CheckpointNotFoundError(path, "is not an EMA ema-ckpt can read")
    name = f"ema_{_label(path.name)}" if many else "ema"
    return (FoundCheckpoint(path, manifest.step, fmt.name, step_source="manifest"),
            PlannedOutput(name, manifest.step, [Term(str(path), manifest.step, 1.0)],
                          profile={"kind": "ema", **manifest.profile}))


def _check_unique(names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise UsageError(f"two candidates are named {name!r}: give each value once")
        seen.add(name)
