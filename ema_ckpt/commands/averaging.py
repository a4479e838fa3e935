"""``posthoc`` and ``average``: weighted sums of checkpoints, planned first, then streamed.

A run is a :class:`~ema_ckpt.plans.Plan` (outputs × terms), computed from steps and manifests
alone (``dry_run=True`` returns it), then a :class:`~ema_ckpt.sums.SumJob`: one pass over the
inputs however many outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..jobs import run_job
from ..options import check_texts, command_options
from ..plans import Plan, find_snapshots, plan_average, plan_posthoc
from ..profile_specs import parse_weights
from ..progress import Progress
from ..storage import Location
from ..sums import RunResult, SumJob, SumOptions


@dataclass(frozen=True, kw_only=True)
class PosthocOptions(SumOptions):
    """Everything a :func:`posthoc` run needs; checked when made."""

    sigma_rels: tuple[str, ...] = ()
    gammas: tuple[str, ...] = ()
    at_step: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_texts(self, "sigma_rels", "gammas")
        if not self.sigma_rels and not self.gammas:
            raise UsageError("give at least one {sigma_rels} or {gammas}", mentions=("sigma_rels", "gammas"))

    @property
    def single_output(self) -> bool:
        return False

    def make_plan(self) -> Plan:
        return plan_posthoc(self.checkpoints, sigma_rels=self.sigma_rels, gammas=self.gammas, at_step=self.at_step,
                            step_regex=self.step_regex, exclude_paths=[self.out], skip=self.skip,
                            step_from=self.step_from, component=self.component, read=self.read)


@dataclass(frozen=True, kw_only=True)
class AverageOptions(SumOptions):
    """Everything an :func:`average` run needs; checked when made."""

    last: int | None = None
    from_step: int | None = None
    to_step: int | None = None
    every: int | None = None
    weights: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
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
                            component=self.component, read=self.read)


def posthoc(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location,
            sigma_rels: Sequence[str] = (), gammas: Sequence[str] = (), at_step: int | None = None,
            step_regex: str | None = None, step_from: str | None = None, component: str | None = None,
            skip: Sequence[str | Location] = (), dtype: str = "float32", format: str | None = None,
            keep_prefix: bool = False, include: Sequence[str] = (), exclude: Sequence[str] = (),
            average_buffers: bool = False, state_key: str | None = None, inert_globals: Sequence[str] = (),
            dry_run: bool = False, overwrite: bool = False, wait_seconds: float = 0.0, workers: int = 1,
            device: str = "cpu", on_progress: Callable[[Progress], None] | None = None) -> Plan | RunResult:
    """Post-hoc power-function EMAs (EDM2), one per value, at ``out/sigma_rel_<value>``.

    Each output is a directory with its manifest: a DCP checkpoint, or (``format="safetensors"``)
    ``model.safetensors``, its keys named as :func:`~ema_ckpt.consolidate` names them.

    Args:
        checkpoints: a folder of raw checkpoints, or of the snapshots ``accumulate(snapshot_every=…)`` keeps.
        out: parent directory of the outputs.
        sigma_rels, gammas: the profiles as typed: ``"0.05"``, ``"0.05:0.2:0.05"``.
        at_step: T, where the averages end (default: the newest checkpoint).
        step_regex, step_from, component, skip: how checkpoints are placed and which model of
            each is read, as for :func:`~ema_ckpt.accumulate`.
        dtype: accumulation and storage dtype of floating tensors (float32 or float64).
        format: ``dcp``, ``safetensors``, ``hf`` or ``torch`` (default: safetensors for
            safetensors inputs, else dcp).
        keep_prefix: keep the ``model.`` of a DCP ``{"model": …}`` save and a wrapper's prefix.
        include, exclude: glob patterns on keys.
        average_buffers: average MoE routers' statistics too (as for :func:`~ema_ckpt.accumulate`).
        state_key, inert_globals: how single-file checkpoints are read (as for :func:`~ema_ckpt.accumulate`).
        dry_run: return the :class:`~ema_ckpt.plans.Plan` (coefficients) and read no tensor.
        overwrite: replace existing outputs.
        wait_seconds, workers, device: how the run runs (as for :func:`~ema_ckpt.accumulate`).
        on_progress: called after each region.

    Example:
        >>> plan = posthoc("ckpts", out="posthoc", sigma_rels=["0.05", "0.1"], dry_run=True)  # doctest: +SKIP
        >>> [round(sum(t.coefficient for t in o.terms), 12) for o in plan.outputs]              # doctest: +SKIP
        [1.0, 1.0]
    """
    given = dict(locals())
    del given["on_progress"]
    return run_job(SumJob(PosthocOptions(**command_options(given))), on_progress=on_progress)


def average(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location,
            last: int | None = None, from_step: int | None = None, to_step: int | None = None,
            every: int | None = None, weights: str | None = None,
            step_regex: str | None = None, step_from: str | None = None, component: str | None = None,
            skip: Sequence[str | Location] = (), dtype: str = "float32", format: str | None = None,
            keep_prefix: bool = False, include: Sequence[str] = (), exclude: Sequence[str] = (),
            average_buffers: bool = False, state_key: str | None = None, inert_globals: Sequence[str] = (),
            dry_run: bool = False, overwrite: bool = False, wait_seconds: float = 0.0, workers: int = 1,
            device: str = "cpu", on_progress: Callable[[Progress], None] | None = None) -> Plan | RunResult:
    """Average of the selected checkpoints into ``out`` (one directory, as :func:`posthoc` writes);
    uniform unless ``weights`` names a schedule.

    Args:
        checkpoints: a folder of checkpoints, or a list of them.
        out: the output directory.
        last: the newest K; or ``from_step``/``to_step``.
        every: every n-th checkpoint, counted back from the newest.
        weights: ``uniform``, ``linear``, ``minus-sqrt``, ``cosine``, or a CSV file of
            ``step,learning_rate`` rows: a decay schedule as merge weights (WSM).
        dry_run: return the :class:`~ema_ckpt.plans.Plan` and read no tensor.

    The other arguments are :func:`posthoc`'s.

    Example:
        >>> average("ckpts", out="avg", last=5)  # doctest: +SKIP
        >>> average("ckpts", out="avg", last=8, weights="minus-sqrt")  # doctest: +SKIP
    """
    given = dict(locals())
    del given["on_progress"]
    return run_job(SumJob(AverageOptions(**command_options(given))), on_progress=on_progress)


__all__ = ["AverageOptions", "Plan", "PosthocOptions", "RunResult", "average", "find_snapshots", "posthoc"]
