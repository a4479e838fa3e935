"""``select``: choose the best average by the user's own evaluation, and publish it.

The candidates (:mod:`ema_ckpt.choosing.candidates`) are planned from steps alone; those not
yet scored are written ``per_pass`` at a time into a scratch folder and scored by the command,
the scores cached beside the output (a rerun evaluates only what is new). A greedy soup grows
from the best single checkpoint. The best candidate is published at ``out`` with a manifest
naming it and every score. Only weights that were scored are published: each input's
:func:`~ema_ckpt.manifest.fingerprint` is kept with its score and compared before the choice is
read and before it is published; a changed input is refused (exit 4).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..choosing import candidates as planned
from ..choosing.evaluation import EvalOutcome, check_command, evaluate
from ..choosing.plot import draw_scores
from ..choosing.scores import CacheEntry, ScoreCache, candidate_key
from ..choosing.soup import SoupResult, greedy_soup
from ..discovery import checkpoint_paths
from ..dtypes import ACCUMULATE_DTYPES
from ..engine import check_device
from ..errors import EvaluationError, IncompatibleCheckpointError, OptionError
from ..formats.options import read_options_from
from ..jobs import recorded_options, run_job
from ..manifest import Manifest, current_fingerprint
from ..options import RUNTIME
from ..plans import Plan, PlannedOutput, average_output
from ..profile_specs import parse_count_list, parse_weights
from ..progress import Progress
from ..storage import (
    Location,
    as_path,
    output_location,
    output_lock,
    output_path,
    scratch_beside,
    size_without_requests,
)
from ..sums import SUM_FORMATS, RunResult, SumJob, SumOptions

__all__ = ["CandidateScore", "SelectEvent", "SelectResult", "select"]

_CANDIDATE_RECORDED = frozenset({"format", "dtype", "include", "exclude", "keep_prefix", "state_key",
                                 "average_buffers"})
_SUM_OPTIONS = ("dtype", "include", "exclude", "keep_prefix", "state_key", "inert_globals", "average_buffers",
                "workers", "device", "wait_seconds")
DEFAULT_PER_PASS = 8
"""Candidates written per pass over the inputs, at most (each takes a model's size on disk)."""


@dataclass(frozen=True, kw_only=True)
class _CandidateSums(SumOptions):
    """The options of a sum whose plan was made beforehand (candidates, the chosen one)."""

    plan: Plan = field(metadata=RUNTIME)
    single: bool = field(default=False, metadata=RUNTIME)
    overwrite: bool = field(default=True, metadata=RUNTIME)

    def recorded(self) -> dict[str, Any]:
        """How the candidate was read and written; the choice is recorded beside (the job's ``extra_manifest``)."""
        return {name: value for name, value in recorded_options(self).items() if name in _CANDIDATE_RECORDED}

    @property
    def single_output(self) -> bool:
        return self.single

    def make_plan(self) -> Plan:
        return dataclasses.replace(self.plan, outputs=list(self.plan.outputs), notes=list(self.plan.notes))


@dataclass(frozen=True, slots=True)
class SelectEvent:
    """Progress of a selection: ``kind`` is ``cached``, ``writing`` (a pass), ``evaluated`` or ``failed``."""

    kind: str
    name: str
    index: int
    total: int
    score: float | None = None
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate's result: its score (None: failed, ``error`` says why) and whether it came from the cache."""

    name: str
    score: float | None
    error: str | None
    cached: bool
    seconds: float
    output: PlannedOutput


@dataclass(slots=True)
class SelectResult:
    """What a selection found and published: ``chosen``, the best candidate's name; ``scores``,
    every candidate in plan order (the soup last); ``run``, what writing ``out`` wrote; ``plot``,
    the score plot (None without matplotlib); ``evaluated``, how many evaluations ran."""

    plan: Plan
    chosen: str
    score: float
    scores: list[CandidateScore]
    out: Location
    run: RunResult | None
    evaluated: int
    soup: SoupResult | None = None
    plot: Path | None = None
    cache: Path | None = None


class _Selector:
    """One selection run: the plan, the cache, and how candidates are written and scored."""

    def __init__(self, plan: Plan, opts: dict[str, Any], work: Path,
                 on_event: Callable[[SelectEvent], None] | None) -> None:
        self.plan, self.opts, self.work = plan, opts, work
        self.cache = ScoreCache(work / "scores.json")
        self.fingerprints: dict[str, str] = {}
        self.on_event = on_event or (lambda _e: None)
        self.results: dict[str, CandidateScore] = {}
        self.evaluated = 0
        self.context = {"eval": opts["eval_command"], "metric": opts["metric"], "format": opts["eval_format"],
                        "dtype": opts["dtype"], "include": list(opts["include"]), "exclude": list(opts["exclude"]),
                        "keep_prefix": opts["keep_prefix"], "state_key": opts["state_key"],
                        **({"average_buffers": True} if opts["average_buffers"] else {})}

    def key(self, output: PlannedOutput) -> str:
        return candidate_key(output.terms, context=self.context, fingerprints=self.fingerprints)

    def score_all(self, outputs: Sequence[PlannedOutput], *, at: tuple[int, int] | None = None) -> None:
        """Score every output: cached ones at once, the rest written ``per_pass`` at a time.
        ``at``: (position, total) shown for a single output (a soup's try)."""
        shift, total = (at[0] - 1, at[1]) if at is not None else (0, len(outputs))
        pending, first_of = [], {}
        for index, output in enumerate(outputs, start=shift):
            key = self.key(output)
            entry = self.cache.get(key)
            if entry is not None:
                self._record(output, EvalOutcome(entry.score, None, entry.seconds), cached=True)
                self.on_event(SelectEvent("cached", output.name, index + 1, total, entry.score))
            elif key in first_of:  # the same terms under another name: scored once
                continue
            else:
                first_of[key] = output
                pending.append((index, output, key))
        per_pass = self.opts["per_pass"]
        for start in range(0, len(pending), per_pass):
            batch = pending[start:start + per_pass]
            self.on_event(SelectEvent("writing", ", ".join(o.name for _, o, _ in batch), batch[0][0] + 1, total))
            with self._written([o for _, o, _ in batch]) as paths:
                for (index, output, key), path in zip(batch, paths, strict=True):
                    self._evaluate(output, key, path, index + 1, total)
        for output in outputs:  # duplicates take their twin's score
            if output.name not in self.results:
                twin = first_of[self.key(output)]
                self.results[output.name] = dataclasses.replace(self.results[twin.name], name=output.name,
                                                                output=output)

    @contextlib.contextmanager
    def _written(self, outputs: Sequence[PlannedOutput]) -> Iterator[list[Path]]:
        scratch = self.work / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)  # a killed run's leftovers
        scratch.mkdir(parents=True)
        plan = _plan_of(self.plan, outputs)
        try:
            for output in outputs:
                self.key(output)  # every input fingerprinted before it is read
            result = run_job(SumJob(self._sums(plan, scratch, single=False, fmt=self.opts["eval_format"])),
                             on_progress=self.opts["on_progress"])
            assert isinstance(result, RunResult)
            # what was read is what the keys name: no input changed while it was being read
            _check_inputs({t.path: self.fingerprints[t.path] for o in outputs for t in o.terms},
                              ", ".join(o.name for o in outputs), when="while it was read to be scored")
            yield [Path(str(p)) for p in result.outputs]  # the scratch folder is local
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _sums(self, plan: Plan, out: Location, *, single: bool, fmt: str, overwrite: bool = True) -> _CandidateSums:
        return _CandidateSums(plan=plan, out=out, checkpoints=(), format=fmt, single=single, overwrite=overwrite,
                              **{name: self.opts[name] for name in _SUM_OPTIONS})

    def _evaluate(self, output: PlannedOutput, key: str, path: Path, index: int, total: int) -> None:
        outcome = evaluate(self.opts["eval_command"], path, output.name, metric=self.opts["metric"],
                           timeout=self.opts["eval_timeout"], log=self.work / "logs" / f"{output.name}.log")
        self.evaluated += 1
        terms = [{"path": t.path, "step": t.step, "coefficient": t.coefficient} for t in output.terms]
        self.cache.put(key, CacheEntry(output.name, outcome.score, outcome.error, round(outcome.seconds, 3), terms,
                                       {t.path: self.fingerprints[t.path] for t in output.terms}))
        self._record(output, outcome, cached=False)
        self.on_event(SelectEvent("evaluated" if outcome.ok else "failed", output.name, index, total, outcome.score,
                                  outcome.error, outcome.seconds))

    def scored_inputs(self, output: PlannedOutput) -> dict[str, str]:
        """Each input of ``output`` as it was when its score was taken (recorded in the cache)."""
        entry = self.cache.entries.get(self.key(output))
        if entry is not None and entry.inputs:
            return dict(entry.inputs)
        return {t.path: self.fingerprints[t.path] for t in output.terms}  # the key holds them

    def _record(self, output: PlannedOutput, outcome: EvalOutcome, *, cached: bool) -> None:
        self.results[output.name] = CandidateScore(output.name, outcome.score, outcome.error, cached, outcome.seconds,
                                                   output)

    def soup(self, singles: Sequence[PlannedOutput]) -> tuple[SoupResult, PlannedOutput] | None:
        """The greedy soup of the single checkpoints (each scored already), or None without any."""
        by_name = {o.name: o for o in singles}
        found = {str(c.path): c for c in self.plan.inputs}
        newest_first = sorted(singles, key=lambda o: -o.step)
        members_of: dict[tuple[str, ...], PlannedOutput] = {}
        tries = itertools.count(1)

        def score(group: Sequence[str]) -> float | None:
            if len(group) == 1:
                return self.results[group[0]].score
            checkpoints = sorted((found[by_name[n].terms[0].path] for n in group), key=lambda c: (c.step, str(c.path)))
            # the soup so far and one more, averaged uniformly
            output = average_output(f"soup+{group[-1]}", checkpoints, last=len(checkpoints))
            members_of[tuple(group)] = output
            self.score_all([output], at=(next(tries), len(singles) - 1))
            return self.results[output.name].score

        try:
            soup = greedy_soup([o.name for o in newest_first], score, maximize=self.opts["maximize"])
        except ValueError:
            return None
        whole = by_name[soup.members[0]] if len(soup.members) == 1 else members_of[tuple(soup.members)]
        final = dataclasses.replace(whole, name="soup_greedy")
        final.profile = {"kind": "soup", "members": [by_name[n].step for n in soup.members]}
        self.results["soup_greedy"] = CandidateScore("soup_greedy", soup.score, None, False, 0.0, final)
        return soup, final


def select(checkpoints: str | Location | Sequence[str | Location], *, out: str | Location, eval_command: str | None,
           sigma_rels: Sequence[str] = (), gammas: Sequence[str] = (), lasts: Sequence[int | str] = (),
           every: int | None = None, weights: Sequence[str] = (), emas: Sequence[str | Location] = (),
           singles: int | str | None = None, soup: str | None = None, at_step: int | None = None,
           metric: str | None = None, maximize: bool = False, eval_format: str = "safetensors",
           format: str | None = None, dtype: str = "float32", include: Sequence[str] = (),
           exclude: Sequence[str] = (), keep_prefix: bool = False, step_regex: str | None = None,
           step_from: str | None = None, component: str | None = None,
           skip: Sequence[str | Location] = (), state_key: str | None = None, inert_globals: Sequence[str] = (),
           average_buffers: bool = False,
           per_pass: int | None = None, eval_timeout: float | None = None, work_dir: str | Path | None = None,
           dry_run: bool = False, overwrite: bool = False, workers: int = 1, device: str = "cpu",
           wait_seconds: float = 0.0,
           on_event: Callable[[SelectEvent], None] | None = None,
           on_progress: Callable[[Progress], None] | None = None) -> Plan | SelectResult:
    """Evaluate candidate averages with ``eval_command`` and publish the best at ``out``.

    Args:
        checkpoints: a folder of checkpoints (or of power-EMA snapshots), or a list of them.
        out: where the chosen average is written (a directory with its manifest).
        eval_command: a shell line holding ``{path}`` (and optionally ``{name}``); its score is
            the last number it prints, or ``metric`` of its last JSON line.
        sigma_rels, gammas: post-hoc power EMAs (``"0.05:0.25:0.05"``), as for :func:`~ema_ckpt.posthoc`.
        lasts: averages of the newest K (``[4, 8]`` or ``"2:16:2"``), ``every`` apart, once per
            ``weights`` (``uniform``, ``linear``, ``minus-sqrt``, ``cosine``, a learning-rate CSV).
        emas: ``accumulate`` outputs, each a candidate as it is.
        singles: each of the newest K checkpoints alone (``"all"``: every one).
        soup: ``"greedy"``: a greedy soup of the single checkpoints (all of them unless ``singles``).
        maximize: higher scores are better (default: lower, a loss).
        eval_format: how candidates are written for the command: ``safetensors``, ``dcp``, ``hf``, ``torch``.
        format: the format of ``out`` (default: ``eval_format``).
        average_buffers: average routers' statistics too (default: taken from the newest
            checkpoint, see :data:`~ema_ckpt.selection.NON_WEIGHT_BUFFERS`).
        step_regex, step_from, component: how checkpoints are placed and which model of each is
            read, as for :func:`~ema_ckpt.accumulate`.
        per_pass: candidates written per pass over the inputs (default: as many as fit the
            scratch disk, at most 8).
        eval_timeout: seconds before an evaluation counts as failed.
        work_dir: scores cache, logs and scratch (default: ``<out>.select`` beside ``out``).
        dry_run: return the :class:`~ema_ckpt.plans.Plan` of the candidates; read no tensor, run nothing.
        overwrite: replace an existing ``out`` that an earlier ``select`` did not write (one it
            wrote is replaced anyway).
        on_event: called as each candidate is written, scored, or found in the cache.

    Raises:
        EvaluationError: every evaluation failed (nothing published; the scores kept are cached).

    Example:
        >>> result = select("ckpts/", out="best/", eval_command="python eval.py {path}",
        ...                 sigma_rels=["0.05:0.25:0.05"], lasts=[4, 8])   # doctest: +SKIP
        >>> result.chosen, result.score                                      # doctest: +SKIP
        ('sigma_rel_0.15', 2.31)
    """
    given = dict(locals())
    out_location = output_location(out)
    if soup not in (None, "greedy"):
        raise OptionError("soup", f"must be 'greedy', got {soup!r}", value=soup)
    count = None if singles is None else (planned.ALL if str(singles) == "all" else parse_count_list(str(singles),
                                                                                                    "singles")[0])
    if soup == "greedy" and count is None:
        count = planned.ALL
    last_values = [k for item in lasts for k in parse_count_list(str(item), "lasts")]
    for w in weights:
        parse_weights(w)
    spec = planned.CandidateSpec(tuple(sigma_rels), tuple(gammas), tuple(last_values), every, tuple(weights),
                                 tuple(as_path(p) for p in emas), count, at_step)
    for name, value, allowed in (("eval_format", eval_format, SUM_FORMATS),
                                 ("format", format or eval_format, SUM_FORMATS), ("dtype", dtype, ACCUMULATE_DTYPES)):
        if value not in allowed:
            raise OptionError(name, f"must be one of {', '.join(allowed)}, got {value!r}", value=value)
    if not dry_run:
        if not eval_command:
            raise OptionError("eval_command", "is required (unless dry_run): the command that scores a candidate",
                              value=None)
        check_command(eval_command)
    if per_pass is not None and per_pass < 1:
        raise OptionError("per_pass", f"must be at least 1, got {per_pass}", value=per_pass)
    check_device(device)
    read = read_options_from(SimpleNamespace(state_key=state_key, inert_globals=tuple(inert_globals)))
    plan = planned.plan_candidates(checkpoint_paths(checkpoints), spec, step_regex=step_regex,
                                   exclude_paths=[out_location], skip=skip, step_from=step_from,
                                   component=component, read=read)
    if dry_run:
        return plan
    out_location = output_path(out_location)
    work = Path(work_dir) if work_dir is not None else scratch_beside(out_location, f"{out_location.name}.select")
    opts = given | {"include": tuple(include), "exclude": tuple(exclude), "inert_globals": read.inert_globals,
                    "per_pass": per_pass or _default_per_pass(plan, work)}
    work.mkdir(parents=True, exist_ok=True)
    with output_lock(work, wait_seconds=wait_seconds):
        selector = _Selector(plan, opts, work, on_event)
        candidates = [o for o in plan.outputs if o.profile.get("kind") != "single" or soup is None or singles]
        selector.score_all(plan.outputs)
        soup_result = None
        if soup == "greedy":
            made = selector.soup([o for o in plan.outputs if o.profile.get("kind") == "single"])
            if made is not None:
                soup_result = made[0]
                candidates.append(made[1])
        return _publish(selector, plan, candidates, soup_result, out_location, format or eval_format)


def _publish(selector: _Selector, plan: Plan, candidates: list[PlannedOutput], soup: SoupResult | None,
             out: Location, fmt: str) -> SelectResult:
    opts = selector.opts
    scores = [selector.results[o.name] for o in candidates]
    scored = {s.name: s.score for s in scores if s.score is not None}
    if not scored:
        failures = [s for s in scores if s.error]
        first = f" (first: {failures[0].name}: {failures[0].error})" if failures else ""
        raise EvaluationError(f"the evaluation command failed on all {len(scores)} candidates{first}; "
                              f"logs in {selector.work / 'logs'}")
    name = (max if opts["maximize"] else min)(scored, key=scored.__getitem__)  # ties: the first in plan order
    best = selector.results[name]
    final_plan = _plan_of(plan, [dataclasses.replace(best.output, name=name)])
    choice = {"selected": {
        "candidate": name, "score": scored[name], "metric": opts["metric"] or "last number printed",
        "maximize": opts["maximize"], "eval": opts["eval_command"], "eval_format": opts["eval_format"],
        "scores": [{"name": s.name, "score": s.score, **({"error": s.error} if s.error else {})} for s in scores],
        **({"soup": {"members": list(soup.members), "path": [dataclasses.asdict(p) for p in soup.path]}}
           if soup is not None else {}),
    }}
    replace = opts["overwrite"] or _made_by_select(out)
    scored_inputs = selector.scored_inputs(best.output)
    _check_inputs(scored_inputs, name)  # before a byte is read for out
    job = _ChosenJob(selector._sums(final_plan, out, single=True, fmt=fmt, overwrite=replace), extra_manifest=choice,
                     scored=scored_inputs, candidate=name)
    run = run_job(job, on_progress=opts["on_progress"])
    assert isinstance(run, RunResult)
    sigma = {o.name: o.sigma_rel for o in plan.outputs if o.sigma_rel is not None}
    picture = draw_scores(selector.work / "scores.png", scored, sigma, name, metric=opts["metric"] or "score",
                          maximize=opts["maximize"])
    return SelectResult(final_plan, name, scored[name], scores, out, run, selector.evaluated, soup, picture,
                        selector.cache.path)


@dataclass
class _ChosenJob(SumJob):
    """The chosen candidate's sum, its inputs checked against the fingerprints scored once it has
    been read and before it is published (a rewrite during the read would publish other weights)."""

    scored: dict[str, str] = field(default_factory=dict)
    candidate: str = ""

    def manifests(self, plan: Any, computed: Any) -> list[Manifest | None]:
        _check_inputs(self.scored, self.candidate, when="after it was scored, while it was written")
        return super().manifests(plan, computed)


def _check_inputs(scored: dict[str, str], name: str, *, when: str = "after it was scored") -> None:
    """Refuse (exit 4) when an input is no longer what ``scored`` fingerprinted."""
    for path, was in scored.items():
        now = current_fingerprint(as_path(path))
        if now != was:
            how = "was removed" if now is None else "was rewritten"
            raise IncompatibleCheckpointError(
                f"{path} {how} {when} (candidate {name}); nothing was published: run select again to "
                "score the checkpoints as they are now")


def _plan_of(plan: Plan, outputs: Sequence[PlannedOutput]) -> Plan:
    """A plan of ``outputs`` alone, over the inputs of ``plan`` they use (its notes kept)."""
    used = {t.path for o in outputs for t in o.terms}
    return Plan("select", [c for c in plan.inputs if str(c.path) in used], list(outputs), list(plan.notes))


def _made_by_select(out: Location) -> bool:
    """Whether ``out`` holds an earlier selection's choice (replaced without ``overwrite``)."""
    manifest = Manifest.read(out)
    return manifest is not None and "selected" in manifest.options


def _default_per_pass(plan: Plan, work: Path) -> int:
    """As many candidates as the scratch disk holds (each about the newest input's size), at most 8."""
    newest = max(plan.inputs, key=lambda c: c.step, default=None)
    if newest is None:
        return DEFAULT_PER_PASS
    try:
        size = size_without_requests(as_path(newest.path))  # None: a listing's cost; the default serves
        if size is None:
            return DEFAULT_PER_PASS
        probe = work if work.exists() else work.parent
        free = shutil.disk_usage(probe if probe.exists() else Path.cwd()).free
    except OSError:
        return DEFAULT_PER_PASS
    return max(1, min(DEFAULT_PER_PASS, int(0.8 * free) // max(size, 1)))
