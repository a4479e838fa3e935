"""What an ``accumulate`` run folds: each EMA kept at OUT (an :class:`Accumulator`: its
profile, the manifest of what it holds, the checkpoints newer than it) and its lerp weights,
the previous EMA first with weight 1 (:func:`~ema_ckpt.maths.fold_coefficients`: the Σ cᵢ·θᵢ a
dry run shows).

Example:
    >>> make_profile(decay=0.999, half_life=None, per_checkpoint=False, warmup=False).describe()
    'EMA, decay 0.999 per step (half-life 692.8 steps)'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from . import maths, profile_specs
from .discovery import FoundCheckpoint, LeftPart, discover
from .errors import IncompatibleCheckpointError, ManifestMismatchError, Note, OptionError, UsageError
from .formats.base import CheckpointReader
from .formats.options import read_options_from
from .formats.safetensors.reader import SafetensorsReader
from .manifest import MANIFEST_NAME, FoldedCheckpoint, Manifest, current_fingerprint, fingerprint
from .maths import ExponentialProfile, PowerProfile, fold_coefficients, profile_from_dict
from .options import InputFields
from .plans import EXPONENTIAL_LONGER, POWER_LONGER, PlannedOutput, Term, find_snapshots, sparse_warning
from .plans import Plan as AveragePlan
from .selection import check_compatible, select_keys
from .storage import Location, as_path, destination_for, output_location

DEFAULT_OUT_NAME = "ema"
Profile = ExponentialProfile | PowerProfile


@dataclass(frozen=True, slots=True)
class FoldTerm:
    """One input's share of an EMA after this run (Σ coefficients = 1)."""

    path: str
    step: int
    coefficient: float


@dataclass(slots=True)
class Accumulator:
    name: str
    final: Location
    profile: Profile
    previous: Manifest | None
    new: list[FoundCheckpoint] = field(default_factory=list)
    snapshot_steps: list[int] = field(default_factory=list)


@dataclass(slots=True)
class AccumulateResult:
    """What an ``accumulate`` run did (or, with ``dry_run``, would do: see ``plan``)."""

    out: Location
    step: int
    folded: list[FoldedCheckpoint]
    up_to_date: bool
    notes: list[str] = field(default_factory=list)
    terms: list[FoldTerm] = field(default_factory=list)
    """The first EMA's terms (see ``terms_by_output`` for every EMA of a power-EMA run)."""
    terms_by_output: dict[str, list[FoldTerm]] = field(default_factory=dict)
    """Each EMA's terms, by its output directory."""
    keys: int = 0
    bytes_read: int = 0
    """Bytes of tensor data read from the checkpoints and the previous EMAs."""
    bytes_written: int = 0
    """Bytes of the files written (on disk: data, ``.metadata`` and manifests, snapshots included)."""
    files_written: int = 0
    seconds: float = 0.0
    profile: str = ""
    outputs: list[Location] = field(default_factory=list)
    snapshots: list[Location] = field(default_factory=list)
    plan: AveragePlan | None = None
    components: dict[str, AccumulateResult] = field(default_factory=dict)
    """Each component's own run, by its name, where the checkpoints hold several (``OUT/<name>``)."""

    @classmethod
    def merged(cls, out: Location, runs: dict[str, AccumulateResult]) -> AccumulateResult:
        """One result of the runs of several components (each in ``runs``, by name)."""
        results = list(runs.values())
        folded = {c.step: c for r in reversed(results) for c in r.folded}  # one line per checkpoint
        return cls(
            out, max(r.step for r in results), sorted(folded.values(), key=lambda c: (c.step, c.path)),
            all(r.up_to_date for r in results),
            [name + ": " + Note.of(line) for name, r in runs.items() for line in r.notes],
            terms=results[0].terms,
            terms_by_output={k: v for r in results for k, v in r.terms_by_output.items()},
            keys=sum(r.keys for r in results), bytes_read=sum(r.bytes_read for r in results),
            bytes_written=sum(r.bytes_written for r in results), files_written=sum(r.files_written for r in results),
            seconds=sum(r.seconds for r in results), profile=results[0].profile,
            outputs=[o for r in results for o in r.outputs], snapshots=[s for r in results for s in r.snapshots],
            plan=results[0].plan, components=runs,
        )


def find_new(accumulators: Sequence[Accumulator], inputs: InputFields, *, out: Location,
             snapshot_every: int | None, notes: list[str]) -> list[LeftPart]:
    """Set each accumulator's new checkpoints (and snapshot steps), from discovery of the ``inputs``.

    A checkpoint is new when it is past the EMA's step and was never folded; a single file the
    trainer has written over since it was folded, with a newer step, is new again (nanoGPT's
    ``ckpt.pt``). Checkpoints recorded as skipped stay skipped while they are unchanged. Returns
    the model-bearing parts of the checkpoints that are not read, each with the reason.
    """
    records = {as_path(c.path).resolve(): c for acc in accumulators if acc.previous is not None
               for c in acc.previous.checkpoints}
    folded = {path: c.step for path, c in records.items()}
    starts = [acc.previous.step if acc.previous is not None else None for acc in accumulators]
    newest = min((s for s in starts if s is not None), default=None)
    component = inputs.component
    found = discover(inputs.checkpoints, step_regex=inputs.step_regex, step_from=inputs.step_from,
                     component=component, exclude=[out.parent if component and out.name == component else out],
                     skip=inputs.skip, known=folded, compare_after=None if None in starts else newest,
                     read=read_options_from(inputs))
    notes.extend(found.notes)
    _refuse_rewritten(accumulators, found.checkpoints, newest)
    for c in found.checkpoints:
        done = folded.get(c.path.resolve())
        if done is None or done == c.step:
            continue
        if _saved_again(c, done, newest, records[c.path.resolve()].fingerprint):
            notes.append(f"{c.path} was saved again since it was folded at step {done}: it is new at step {c.step}")
            del folded[c.path.resolve()]
        else:
            notes.append(f"skipped {c.path}: folded before at step {done}, it now reads step {c.step}")
    snapshots_on_disk = find_snapshots([out]) if snapshot_every else []
    for acc in accumulators:
        start = acc.previous.step if acc.previous is not None else None
        recorded = {s.get("path"): s for s in (acc.previous.skipped if acc.previous else [])}
        acc.new = []
        for c in found.checkpoints:
            if (start is not None and c.step <= start) or c.path.resolve() in folded:
                continue
            skip_record = recorded.get(str(c.path.resolve()))
            if skip_record is not None and skip_record.get("fingerprint") in (None, fingerprint(c.path)):
                if acc is accumulators[0]:
                    notes.append(f"skipped {c.path} (step {c.step}): recorded as skipped "
                                 f"({skip_record.get('reason')}) in {acc.final / MANIFEST_NAME}")
                continue
            acc.new.append(c)
        if start is not None:
            _refuse_backwards(acc, found.checkpoints, start)
        if snapshot_every:
            assert isinstance(acc.profile, PowerProfile)
            taken = [s.step for s in snapshots_on_disk if abs(s.gamma - acc.profile.gamma) < 1e-12]
            acc.snapshot_steps = snapshot_steps([c.step for c in acc.new], max(taken, default=None), snapshot_every)
    return found.left


def _refuse_rewritten(accumulators: Sequence[Accumulator], found: Sequence[FoundCheckpoint],
                      ema_step: int | None) -> None:
    """Refuse to fold on when a folded checkpoint still on disk no longer has its recorded
    fingerprint (a rollback: the trainer saved over the same paths and steps). One that vanished
    is retention; a single file written over with a newer step is new (:func:`_saved_again`)."""
    latest: dict[Location, tuple[Accumulator, FoldedCheckpoint]] = {}
    for acc in accumulators:
        for record in acc.previous.checkpoints if acc.previous is not None else []:
            path = as_path(record.path).resolve()
            if path not in latest or record.step >= latest[path][1].step:
                latest[path] = (acc, record)
    by_path = {c.path.resolve(): c for c in found}
    rewritten = []
    for path, (acc, record) in latest.items():
        now = current_fingerprint(path)
        if now is None or now == record.fingerprint:
            continue
        checkpoint = by_path.get(path)
        if checkpoint is not None and _saved_again(checkpoint, record.step, ema_step, record.fingerprint):
            continue
        rewritten.append((record.step, path, acc))
    if not rewritten:
        return
    step, path, acc = min(rewritten)
    gone = sorted(r.step for p, (_, r) in latest.items() if not p.exists())
    on_disk = sorted(c.step for c in found)
    lost = (f"; the {len(gone)} folded checkpoint(s) no longer on disk (steps {_steps(gone)}) cannot be folded "
            "again: their share of the EMA is lost") if gone else ""
    more = f" (and {len(rewritten) - 1} more)" if len(rewritten) > 1 else ""
    raise IncompatibleCheckpointError(
        f"{path} (step {step}) was folded into {acc.final}, and has been written again since{more}: the trainer "
        "went back and saved over it (a rollback?), and folding on would mix two runs. Pass {restart=True} to "
        f"rebuild the EMA from the {len(on_disk)} checkpoint(s) on disk (steps {_steps(on_disk)}){lost}",
        remedy="restart")


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, {steps[1]}, …, {steps[-1]}"


def _saved_again(checkpoint: FoundCheckpoint, folded_at: int, ema_step: int | None, recorded: str | None) -> bool:
    """A single file folded before that the trainer has since written over with a newer step
    (nanoGPT's ``ckpt.pt``, a ``last.ckpt`` kept alone): a new checkpoint at the same path.
    A folder rewritten in place, or a file going back in steps, is not (a rollback)."""
    return (checkpoint.path.is_file() and checkpoint.step > folded_at and ema_step is not None
            and checkpoint.step > ema_step and recorded is not None and recorded != fingerprint(checkpoint.path))


def default_out(checkpoints: Sequence[Location]) -> Location:
    """``<folder>/ema`` for a single folder of checkpoints."""
    if len(checkpoints) == 1 and checkpoints[0].is_dir():
        return output_location(checkpoints[0] / DEFAULT_OUT_NAME)
    raise OptionError("out", "is required when more than one path is given")


def make_profile(
    *, decay: float | None, half_life: float | None, per_checkpoint: bool, warmup: bool
) -> ExponentialProfile:
    """The classic profile named by exactly one of ``decay`` / ``half_life``."""
    if (decay is None) == (half_life is None):
        raise UsageError("give exactly one of {decay} or {half_life} (or {sigma_rels}/{gammas})",
                         mentions=("decay", "half_life", "sigma_rels", "gammas"))
    if half_life is not None:
        if per_checkpoint:
            raise OptionError("half_life", "counts steps; use {decay} with {per_checkpoint}",
                              mentions=("decay", "per_checkpoint"))
        return ExponentialProfile.from_half_life(half_life, warmup=warmup)
    assert decay is not None
    return ExponentialProfile(decay=decay, per_checkpoint=per_checkpoint, warmup=warmup)


def named_profiles(
    decay: float | None, half_life: float | None, per_checkpoint: bool, warmup: bool,
    sigma_rels: Sequence[str], gammas: Sequence[str], snapshot_every: int | None,
) -> list[tuple[str, Profile]]:
    if sigma_rels or gammas:
        if decay is not None or half_life is not None or per_checkpoint or warmup:
            raise UsageError("{sigma_rels}/{gammas} (power EMAs) cannot be combined with {decay}/{half_life}",
                             mentions=("sigma_rels", "gammas", "decay", "half_life"))
        return [(name, PowerProfile(gamma, typed))
                for name, gamma, typed in profile_specs.power_profiles(sigma_rels, gammas)]
    if snapshot_every is not None:
        raise OptionError("snapshot_every", "keeps power EMAs: use it with {sigma_rels} or {gammas}",
                          value=snapshot_every, mentions=("sigma_rels", "gammas"))
    return [(DEFAULT_OUT_NAME, make_profile(decay=decay, half_life=half_life,
                                            per_checkpoint=per_checkpoint, warmup=warmup))]


def _refuse_backwards(acc: Accumulator, checkpoints: list[FoundCheckpoint], start: int) -> None:
    """Refuse a new checkpoint at or before the EMA's step: steps went backwards. One folded under
    another path (``watch`` folds staged copies) is known by its step and fingerprint. Where
    folded steps' checkpoints are gone, the message says a rebuild would lose them."""
    previous = acc.previous
    assert previous is not None  # only an EMA that exists stands at a step
    known = {c.path for c in previous.checkpoints} | {s["path"] for s in previous.skipped}
    folded = {(c.step, c.fingerprint) for c in previous.checkpoints}
    held = [c for c in checkpoints if c.step <= start
            and (str(c.path.resolve()) in known or _folded_elsewhere(c, folded))]
    late = [c for c in checkpoints if c.step <= start and c not in held]
    if not late:
        return
    head = (f"{late[0].path}: step {late[0].step} is at or before step {start}, where the EMA {acc.final} "
            "stands, but was never folded: steps went backwards (a job restarted into the same folder?); ")
    on_disk = {c.step for c in held}
    gone = sorted({c.step for c in previous.checkpoints if c.step not in on_disk and not _exists(c.path)})
    if not gone:
        raise IncompatibleCheckpointError(head + "move it away, or pass {restart=True} to rebuild the EMA",
                                          remedy="restart")
    raise IncompatibleCheckpointError(
        head + f"move it away. Rebuilding the EMA ({{restart=True}}) would lose the {len(gone)} folded step(s) "
        f"whose checkpoints are gone (steps {_steps(gone)})", mentions=("restart",))


def _folded_elsewhere(checkpoint: FoundCheckpoint, folded: set[tuple[int, str]]) -> bool:
    """Whether ``checkpoint`` is one the EMA folded (its step and fingerprint recorded), at another path."""
    if not any(step == checkpoint.step for step, _ in folded):
        return False
    now = current_fingerprint(checkpoint.path)
    return now is not None and (checkpoint.step, now) in folded


def _exists(path: str) -> bool:
    try:
        return as_path(path).exists()
    except OSError:
        return False


def skip_records(skipped: Sequence[tuple[FoundCheckpoint, str]]) -> list[dict[str, Any]]:
    return [{"path": str(c.path.resolve()), "step": c.step, "reason": reason, "fingerprint": fingerprint(c.path)}
            for c, reason in skipped]


def record_skips(accumulators: list[Accumulator], skipped: Sequence[tuple[FoundCheckpoint, str]]) -> None:
    """Record skips in each existing EMA's manifest when nothing else is written (only the
    manifest is replaced, atomically)."""
    for acc in accumulators:
        if acc.previous is None or not skipped:
            continue
        acc.previous.skipped = acc.previous.skipped + skip_records(skipped)
        acc.previous.write(acc.final)

def snapshot_steps(new_steps: list[int], last: int | None, every: int) -> list[int]:
    """Checkpoint steps at which a snapshot is taken: the first at or after each multiple of K."""
    chosen = []
    for step in new_steps:
        if step // every > (last // every if last is not None else 0):
            chosen.append(step)
            last = step
    return chosen


def check_same_settings(previous: Manifest, profile: Profile, dtype: str, selection: dict[str, Any],
                        out: Location) -> None:
    """Refuse to fold into an EMA made with other settings (``restart`` starts over)."""
    before, mentions = previous.selection, cast(tuple[str, ...], ())
    key, buffers = before.get("state_key"), before.get("average_buffers", False)
    if previous.kind != "ema" or previous.profile != profile.to_dict():
        try:
            held = profile_from_dict(previous.profile).describe()
        except (ValueError, KeyError, UsageError):
            held = str(previous.profile)
        why, mentions = (f"{out} holds an {held}, not an {profile.describe()}; pass {{restart=True}} to start a "
                         "new EMA there, or choose another {out}"), ("out",)
    elif previous.dtype != dtype:
        why, mentions = (f"{out} accumulates in {previous.dtype}, not {dtype}; pass {{restart=True}} or keep "
                         f"{{dtype={previous.dtype}}}"), ("dtype",)
    elif key != selection.get("state_key"):
        def read(key: Any) -> str:
            return f"the state dict {key!r} of each file" if key else "the state dict found in each file"

        why, mentions = (f"{out} was made from {read(key)}, not {read(selection.get('state_key'))}; pass "
                         "{restart=True} to start over, " + ("or drop {state_key}" if key is None else
                                                             f"or pass {{state_key={key}}}")), ("state_key",)
    elif buffers != selection.get("average_buffers", False):
        why, mentions = (f"{out} {'averaged' if buffers else 'took from the newest checkpoint'} the routers' "
                         "statistics (e_score_correction_bias, expert_bias, …); pass {restart=True} to start over, "
                         "or " + ("pass {average_buffers=True}" if buffers else "drop {average_buffers}")), \
            ("average_buffers",)
    elif before != selection:
        why = f"{out} was made with key selection {before}, not {selection}; pass {{restart=True}}"
    else:
        return
    raise ManifestMismatchError(why, remedy="restart", mentions=mentions)


def fold_weights(acc: Accumulator, upto: int | None = None) -> list[tuple[str, int, float]]:
    """(label, step, lerp weight) of an accumulator's fold: previous EMA first, then new checkpoints."""
    rows: list[tuple[str, int, float]] = []
    prev = acc.previous.step if acc.previous is not None else None
    if acc.previous is not None:
        rows.append((str(acc.final), acc.previous.step, 1.0))
    for ckpt in acc.new:
        if upto is not None and ckpt.step > upto:
            break
        rows.append((str(ckpt.path), ckpt.step, 1.0 if prev is None else acc.profile.update_weight(prev, ckpt.step)))
        prev = ckpt.step
    return rows


def fold_terms(acc: Accumulator) -> list[FoldTerm]:
    rows = fold_weights(acc)
    return [FoldTerm(p, s, c) for (p, s, _), c in zip(rows, fold_coefficients([w for *_, w in rows]), strict=True)]


def fold_plan(accumulators: list[Accumulator]) -> AveragePlan:
    outputs = []
    inputs: dict[str, FoundCheckpoint] = {}
    for acc in accumulators:
        rows = fold_weights(acc)
        inputs.update({str(c.path): c for c in acc.new})
        if not rows:
            continue
        coeffs = fold_coefficients([w for *_, w in rows])
        terms = [Term(p, s, c) for (p, s, _), c in zip(rows, coeffs, strict=True)]
        profile = acc.profile
        steps = [t.step for t in terms]
        stats = maths.describe_plan(steps, coeffs, profile=profile if isinstance(profile, ExponentialProfile) else None)
        if isinstance(profile, PowerProfile):
            window = maths.power_window(profile.gamma, steps[-1])
            sigma, gamma, longer = profile.sigma_rel, profile.gamma, POWER_LONGER
        else:
            window = 1.0 / (1.0 - stats.step_decay) if stats.step_decay and stats.step_decay < 1 else float("inf")
            sigma, gamma, longer = stats.sigma_rel, None, EXPONENTIAL_LONGER
        warning = sparse_warning(steps, window, longer) if window != float("inf") else None
        outputs.append(PlannedOutput(
            acc.name, steps[-1], terms, sigma_rel=sigma, gamma=gamma, profile=profile.to_dict(),
            warnings=[warning] if warning else [],
            stats={"sigma_rel": stats.sigma_rel, "mean_age": stats.mean_age, "n_eff": stats.n_eff,
                   "max_abs": stats.max_abs, "half_life": stats.half_life},
        ))
    return AveragePlan("accumulate", sorted(inputs.values(), key=lambda c: c.step), outputs)


def fold_inputs(accumulators: list[Accumulator]) -> tuple[list[Accumulator], list[Location], list[FoundCheckpoint]]:
    """(accumulators with new checkpoints, every path to read: their EMAs then the checkpoints, checkpoints)."""
    active = [acc for acc in accumulators if acc.new]
    sources: list[Location] = [acc.final for acc in active if acc.previous is not None]
    checkpoints = sorted({c.path: c for acc in active for c in acc.new}.values(), key=lambda c: c.step)
    return active, sources + [c.path for c in checkpoints], checkpoints


def check_fold_keys(readers: Sequence[CheckpointReader], sources: Sequence[Location],
                    checkpoints: Sequence[FoundCheckpoint], active: Sequence[Accumulator], include: Sequence[str],
                    exclude: Sequence[str], allow_new_keys: bool) -> list[str]:
    """The keys to fold, once every source agrees on them (metadata only: no tensor is read)."""
    index = {str(p): i for i, p in enumerate(sources)}
    keys = select_keys(readers[-1], include, exclude)
    if not keys:
        raise UsageError(f"{readers[-1].path}: no tensor keys left after {{include}}/{{exclude}}",
                         mentions=("include", "exclude"))
    raw = [index[str(c.path)] for c in checkpoints]
    check_compatible(readers, keys, reference=len(readers) - 1, allow_new_keys=allow_new_keys,
                     same_selection=raw, include=include, exclude=exclude)
    for acc in active:
        if acc.previous is not None and not allow_new_keys:
            extra = sorted(set(readers[index[str(acc.final)]].specs()) - set(keys))
            if extra:
                raise IncompatibleCheckpointError(
                    f"{readers[-1].path}: key {extra[0]!r} of the EMA {acc.final} is gone from the newest checkpoint")
    return keys


def components_to_fold(inputs: InputFields, out: Location) -> list[str]:
    """The components each EMA is made of: ``[""]`` (the checkpoints' own model), or the names of
    the trained models inside them (each its own EMA in ``OUT/<name>``). Reads no weights."""
    if inputs.component is not None:
        return [inputs.component]
    found = discover(inputs.checkpoints, step_regex=inputs.step_regex, step_from=inputs.step_from,
                     all_components=True, exclude=[out], skip=inputs.skip, require=False, compare=False,
                     read=read_options_from(inputs))
    return found.components or [""]


def component_file(component: str | None, out: Location, newest: CheckpointReader) -> str | None:
    """The file name a component read from one safetensors file is written under, so that its
    framework loads it there (``ema/unet/diffusion_pytorch_model.safetensors`` beside its
    ``config.json``), where data files keep their names; else None (a DCP EMA)."""
    if component is None or newest.format_name != "safetensors" or not destination_for(out).names_kept:
        return None
    headers = cast(SafetensorsReader, newest).headers
    return headers[0].path.name if len(headers) == 1 else None


def checkpoint_holding(checkpoints: Sequence[FoundCheckpoint], path: Location) -> FoundCheckpoint | None:
    """The new checkpoint a damaged file belongs to, or None (then it is not a checkpoint's fault)."""
    target = path.resolve()
    for c in checkpoints:
        root = c.path.resolve()
        if target == root or root in target.parents:
            return c
    return None
