"""Held-out loss of the demo's raw checkpoints, its EMA and its post-hoc EMAs; a table and a plot.

Every variant goes through the same code path: its weights are read into a fresh model with
torch's own ``torch.distributed.checkpoint.load`` (a DCP directory) or ``safetensors`` (a file),
then the model is scored on the same held-out sequences::

    python examples/demo/evaluate.py demo              # table, demo/results.json, demo/demo.png
    python examples/demo/evaluate.py demo --check demo/best.safetensors demo/best-4ranks
    python examples/demo/evaluate.py demo --cron   # ema/ against demo/ema-one-shot and a float64 EMA
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file
from task import TinyTransformer, floor_loss, held_out, lm_loss, markov_table

from ema_ckpt.maths import ExponentialProfile, exponential_coefficients
from ema_ckpt.plans import plan_posthoc

if TYPE_CHECKING:
    from matplotlib.figure import Figure

HELD_OUT = 512  # sequences, SEQ_LEN - 1 scored predictions each
console = Console()
Weights = dict[str, torch.Tensor]


@dataclass
class Result:
    name: str
    what: str
    path: str
    loss: float = math.nan
    sigma_rel: float | None = None


def read_model(path: Path) -> Weights:
    """The model's tensors in ``path`` (a safetensors file, or a DCP directory's ``model.*`` keys)."""
    if path.is_file():
        return load_file(path)
    state = TinyTransformer().state_dict()
    dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)  # DCP keys are model.<param>
    return state


@torch.inference_mode()
def held_out_loss(path: Path, data: torch.Tensor) -> float:
    model = TinyTransformer()
    model.load_state_dict(read_model(path))  # every parameter must be there, with its shape
    total = sum(float(lm_loss(model(seq[:, :-1]), seq)) * len(seq) for seq in data.split(256))
    return total / len(data)


def step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])


def checkpoints(folder: Path) -> list[Path]:
    return sorted(folder.glob("step_*"), key=step_of)


def manifest(ema: Path) -> dict:
    return json.loads((ema / "ema-ckpt.json").read_text())


def ema_decay(ema: Path) -> float | None:
    """The per-step decay ema-ckpt recorded in the EMA's manifest (None if not a per-step EMA)."""
    profile = manifest(ema)["profile"]
    per_step = profile.get("kind") == "exponential" and not profile.get("per_checkpoint")
    return profile.get("decay") if per_step else None


def span(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 3 else f"{steps[0]} … {steps[-1]}"


def cron_check(demo: Path) -> int:
    """The EMA that cron runs built, folding new checkpoints only, against one run over every checkpoint
    ever saved (the same bits) and a float64 EMA computed here with torch (float32 rounding apart)."""
    folded = [c["step"] for c in manifest(demo / "ema")["checkpoints"]]
    every = checkpoints(demo / "every-checkpoint")
    kept = {step_of(p) for p in checkpoints(demo / "ckpts")}
    deleted = [s for s in folded if s not in kept]
    gone = f"{len(deleted)} of them since (steps {span(deleted)})" if deleted else "none of them"
    print(f"ema/ folded {len(folded)} checkpoints (steps {span(folded)}); retention has deleted {gone}")
    if folded != [step_of(p) for p in every]:
        print(f"DIFFERENT: training saved steps {span([step_of(p) for p in every])}")
        return 1

    ema, one_shot = read_model(demo / "ema"), read_model(demo / "ema-one-shot")
    same = sum(torch.equal(ema[k], one_shot[k]) for k in ema)
    print(f"ema/ (cron runs 1 and 2) against ema-one-shot/ (one run over all {len(every)}): "
          f"{'the same bits' if same == len(ema) else 'DIFFERENT bits'} in {same} of {len(ema)} tensors")

    decay = ema_decay(demo / "ema")
    assert decay is not None, "the demo's EMA is a per-step EMA (--half-life)"
    reference, prev = {}, 0
    for path in every:  # ema₁ = θ₁, then emaₖ = β^Δ·emaₖ₋₁ + (1 − β^Δ)·θₖ
        weights, step = read_model(path), step_of(path)
        w = 1.0 if not reference else 1.0 - decay ** (step - prev)
        for k, v in weights.items():
            reference[k] = v.double() if k not in reference else torch.lerp(reference[k], v.double(), w)
        prev = step
    worst = max(float((ema[k].double() - reference[k]).abs().max()) for k in ema)
    close = worst <= 1e-5
    print(f"ema/ against a float64 EMA of the same {len(every)} checkpoints: max abs difference {worst:.1e}"
          f"{' (float32 rounding)' if close else ', DIFFERENT'}")
    return int(same != len(ema) or not close)


def evaluate(demo: Path, data: torch.Tensor) -> tuple[list[Result], list[tuple[int, float]]]:
    """The variants (last raw checkpoint, best raw of the second half, EMA, post-hoc EMAs) and the
    held-out loss of every raw checkpoint of the second half of training."""
    raw = checkpoints(demo / "ckpts")
    last = raw[-1]
    curve = [(step_of(p), held_out_loss(p, data)) for p in raw if 2 * step_of(p) >= step_of(last)]
    results = [Result(f"raw {last.name}", "the last checkpoint, as saved", str(last), curve[-1][1])]
    best_step, best_loss = min(curve, key=lambda c: c[1])
    if best_step != step_of(last):  # the luckiest raw checkpoint, for a fair comparison
        path = demo / "ckpts" / f"step_{best_step}"
        what = "the best raw checkpoint of the 2nd half"
        results.append(Result(f"raw {path.name}", what, str(path), best_loss))
    if (demo / "ema").is_dir():
        decay = ema_decay(demo / "ema")
        what = "ema-ckpt accumulate"
        if decay is not None:
            what += f", half-life {math.log(0.5) / math.log(decay):.3g} steps"
        results.append(Result("EMA", what, str(demo / "ema")))
    for path in sorted((demo / "posthoc").glob("sigma_rel_*"), key=lambda p: float(p.name.split("_")[-1])):
        sigma = float(path.name.split("_")[-1])
        results.append(Result(f"σ_rel {sigma:g}", "ema-ckpt posthoc", str(path), sigma_rel=sigma))
    for r in results:
        if math.isnan(r.loss):
            r.loss = held_out_loss(Path(r.path), data)
    return results, curve


def print_table(results: list[Result], floor: float, best: Result) -> None:
    raw = results[0].loss
    table = Table(title=f"Held-out loss ({HELD_OUT} held-out sequences, the same for every row)")
    table.add_column("weights")
    table.add_column("made by")
    table.add_column("held-out loss", justify="right")
    table.add_column("above the floor", justify="right")
    table.add_column("vs raw last", justify="right")
    for r in results:
        change = "" if r is results[0] else f"{r.loss - raw:+.4f}"
        mark = "★ " if r is best else "  "
        style = "bold green" if r is best else None
        table.add_row(mark + r.name, r.what, f"{r.loss:.4f}", f"{r.loss - floor:.4f}", change, style=style)
    table.caption = f"floor {floor:.4f}: the loss of the chain's own probabilities; ★ lowest loss"
    console.print(table)


@dataclass
class Weighting:
    """What the plot's weights panel shows: each average's coefficient per checkpoint step."""

    label: str
    steps: list[int]
    coefficients: list[float]


def weightings(demo: Path, results: list[Result]) -> tuple[Weighting | None, Weighting | None, int | None]:
    """The best post-hoc EMA's and the EMA's weight per checkpoint, and the oldest step retention kept
    (the EMA's weights come from its manifest: every checkpoint it folded, deleted ones included)."""
    sweep = [r for r in results if r.sigma_rel is not None]
    posthoc = None
    if sweep:
        best = min(sweep, key=lambda r: r.loss)
        plan = plan_posthoc(demo / "ckpts", sigma_rels=[f"{best.sigma_rel:g}"]).outputs[0]
        posthoc = Weighting(f"{best.name} (best post-hoc)", [t.step for t in plan.terms],
                            [t.coefficient for t in plan.terms])
    ema, decay = None, ema_decay(demo / "ema") if (demo / "ema").is_dir() else None
    if decay is not None:
        folded = [c["step"] for c in manifest(demo / "ema")["checkpoints"]]
        ema = Weighting("EMA (accumulate)", folded, exponential_coefficients(folded, ExponentialProfile(decay=decay)))
    kept = checkpoints(demo / "ckpts")
    return posthoc, ema, step_of(kept[0]) if kept else None


def figure(
    results: list[Result],
    curve: list[tuple[int, float]],
    floor: float,
    posthoc: Weighting | None,
    ema_weights: Weighting | None,
    oldest_kept: int | None,
) -> Figure:
    """Four panels: loss by σ_rel; each checkpoint's weight; the raw checkpoints against the best average;
    every variant's loss above the floor, one labelled bar each (the averages differ by a hair)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator
    from matplotlib.transforms import blended_transform_factory

    raw, ema = results[0], next((r for r in results if r.name == "EMA"), None)
    sweep = [r for r in results if r.sigma_rel is not None]
    best = min(results, key=lambda r: r.loss)
    fig, ((left, weights), (over_time, bars)) = plt.subplots(2, 2, figsize=(14, 9))

    if sweep:
        sigmas = [r.sigma_rel for r in sweep]
        best_sweep = min(sweep, key=lambda r: r.loss)
        left.plot(sigmas, [r.loss for r in sweep], "o-", color="C0", label="post-hoc EMA (ema-ckpt posthoc)")
        left.plot([best_sweep.sigma_rel], [best_sweep.loss], "*", color="C0", markersize=16,
                  label=f"{best_sweep.name}: the sweep's lowest")
        left.set_xscale("log")
        left.xaxis.set_minor_locator(NullLocator())
        left.set_xticks(sigmas, [f"{s:g}" for s in sigmas])
    left.axhline(raw.loss, color="C3", ls="--", label=f"{raw.name} (no averaging)")
    if ema is not None:  # a mark on the right edge: a line at its level would run along the sweep's curve
        edge = blended_transform_factory(left.transAxes, left.transData)
        left.plot([1.0], [ema.loss], "<", color="C2", ms=11, transform=edge, clip_on=False,
                  label=f"EMA ({ema.what.split(', ')[-1]}), on the right edge")
    left.axhline(floor, color="gray", ls=":", label="floor (the chain's own probabilities)")
    shown = [raw.loss, floor, *(r.loss for r in sweep)]
    low, high = min(shown), max(shown)
    left.set_ylim(low - 0.05 * (high - low), high + 0.5 * (high - low))  # room for the legend above the lines
    left.set_xlabel("σ_rel (EMA length relative to training time)")
    left.set_ylabel("held-out loss")
    left.set_title("Held-out loss by EMA length")
    left.legend(fontsize=8, loc="upper center", ncol=2)

    deleted = [s for s in ema_weights.steps if s < oldest_kept] if ema_weights and oldest_kept is not None else []
    if deleted:
        weights.axvspan(deleted[0], deleted[-1], color="0.9", label="checkpoints deleted by retention (in the EMA)")
    if posthoc is not None:
        gaps = [b - a for a, b in zip(posthoc.steps, posthoc.steps[1:], strict=False)]
        width = 0.4 * min(gaps, default=1)
        weights.bar([s - width / 2 for s in posthoc.steps], posthoc.coefficients, width=width, color="C0",
                    label=posthoc.label)
    if ema_weights is not None:
        gaps = [b - a for a, b in zip(ema_weights.steps, ema_weights.steps[1:], strict=False)]
        width = 0.4 * min(gaps, default=1)
        weights.bar([s + width / 2 for s in ema_weights.steps], ema_weights.coefficients, width=width,
                    color="C2", label=ema_weights.label)
    weights.set_xlabel("checkpoint step")
    weights.set_ylabel("coefficient (weights sum to 1)")
    weights.set_title("Weight of each checkpoint")
    weights.legend(fontsize=8)

    raw_steps, raw_losses = zip(*curve, strict=True)
    over_time.plot(raw_steps, raw_losses, "o-", color="C3", ms=3, label="raw checkpoints")
    over_time.axhline(best.loss, color="C0" if best.sigma_rel is not None else "C2",
                      label=f"{best.name}: the lowest loss (every variant in the next panel)")
    over_time.axhline(floor, color="gray", ls=":", label="floor")
    over_time.set_xlabel("checkpoint step")
    over_time.set_ylabel("held-out loss")
    over_time.set_title("Raw checkpoints against the best average (2nd half)")
    over_time.legend(fontsize=8)

    def colour(r: Result) -> str:
        return "C2" if r is ema else "C0" if r.sigma_rel is not None else "C3"

    rows = list(range(len(results)))[::-1]  # the table's order, top to bottom
    excess = [r.loss - floor for r in results]
    drawn = bars.barh(rows, excess, color=[colour(r) for r in results],
                      edgecolor=["black" if r is best else "none" for r in results])
    bars.bar_label(drawn, labels=[f"{r.loss:.4f}" for r in results], padding=3, fontsize=8)
    bars.set_yticks(rows, [("★ " if r is best else "") + r.name for r in results], fontsize=8)
    bars.set_xlim(0, 1.18 * max(excess))
    bars.set_xlabel("held-out loss above the floor (bar labels: the loss)")
    bars.set_title("Every variant (★ lowest)")

    fig.tight_layout()
    return fig


def plot(demo: Path, results: list[Result], curve: list[tuple[int, float]], floor: float) -> Path | None:
    """DEMO/demo.png (see ``figure``), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, then run the demo again)")
        return None
    fig = figure(results, curve, floor, *weightings(demo, results))
    out = demo / "demo.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def check(demo: Path, paths: list[Path], data: torch.Tensor) -> int:
    """Score ``paths`` (the best weights after consolidate / reshard): the same loss as their source?"""
    best = json.loads((demo / "results.json").read_text())["best"]
    status = 0
    for path in paths:
        loss = held_out_loss(path, data)
        same = abs(loss - best["loss"]) <= 1e-5
        status |= not same
        verdict = "the same as" if same else "DIFFERENT from"
        print(f"{path}: held-out loss {loss:.4f}, {verdict} {best['name']} ({best['loss']:.4f})")
    return status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("demo", type=Path, help="the demo folder (ckpts/, ema/, posthoc/)")
    p.add_argument("--check", type=Path, nargs="+", help="score these weights against the best variant")
    p.add_argument("--cron", action="store_true", help="check ema/ against ema-one-shot/ and a float64 EMA")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp.load(no_dist=True)
    if args.check or args.cron:
        status = check(args.demo, args.check, held_out(HELD_OUT)) if args.check else 0
        return status | (cron_check(args.demo) if args.cron else 0)
    data = held_out(HELD_OUT)

    results, curve = evaluate(args.demo, data)
    floor = floor_loss(markov_table(), data)
    best = min(results, key=lambda r: r.loss)
    print_table(results, floor, best)
    raw = results[0]
    if best is raw:
        print(f"best: {raw.name}: no average beats the last checkpoint in this run")
    else:
        removed = (raw.loss - best.loss) / (raw.loss - floor)
        print(
            f"best: {best.name} ({best.path}): held-out loss {best.loss:.4f} vs {raw.loss:.4f} "
            f"for {raw.name}, {100 * removed:.0f}% of its excess over the floor removed"
        )
    out = plot(args.demo, results, curve, floor)
    if out is not None:
        print(f"plot: {out}")
    summary = {"floor": floor, "best": asdict(best), "results": [asdict(r) for r in results], "raw": curve}
    (args.demo / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.demo / "best").write_text(best.path + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
