"""Held-out loss of the demo's raw checkpoints, its EMA and its post-hoc EMAs; a table and a plot.

Every variant goes through the same code path: its weights are read into a fresh model with
torch's own ``torch.distributed.checkpoint.load`` (a DCP directory) or ``safetensors`` (a file),
then the model is scored on the same held-out sequences::

    python examples/demo/evaluate.py demo              # table, demo/results.json, demo/demo.png
    python examples/demo/evaluate.py demo --check demo/best.safetensors demo/best-4ranks
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file
from task import TinyTransformer, floor_loss, held_out, lm_loss, markov_table

from ema_ckpt.maths import ExponentialProfile, exponential_coefficients
from ema_ckpt.plans import plan_posthoc

HELD_OUT = 1024  # sequences, SEQ_LEN - 1 scored predictions each
console = Console()


@dataclass
class Result:
    name: str
    what: str
    path: str
    loss: float = math.nan
    sigma_rel: float | None = None


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load ``path`` into ``model``; every parameter must be there, with its shape."""
    if path.is_file():
        model.load_state_dict(load_file(path))
        return
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)  # DCP keys are model.<param>
    model.load_state_dict(state)


@torch.inference_mode()
def held_out_loss(path: Path, data: torch.Tensor) -> float:
    model = TinyTransformer()
    load_weights(model, path)
    total = sum(float(lm_loss(model(seq[:, :-1]), seq)) * len(seq) for seq in data.split(256))
    return total / len(data)


def step_of(path: Path) -> int:
    return int(path.name.split("_")[-1])


def ema_decay(ema: Path) -> float | None:
    """The per-step decay ema-ckpt recorded in the EMA's manifest (None if not a per-step EMA)."""
    profile = json.loads((ema / "ema-ckpt.json").read_text())["profile"]
    per_step = profile.get("kind") == "exponential" and not profile.get("per_checkpoint")
    return profile.get("decay") if per_step else None


def evaluate(demo: Path, data: torch.Tensor) -> tuple[list[Result], list[tuple[int, float]]]:
    """The variants (last raw checkpoint, best raw of the second half, EMA, post-hoc EMAs) and the
    held-out loss of every raw checkpoint of the second half of training."""
    raw = sorted((demo / "ckpts").glob("step_*"), key=step_of)
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


def plot(demo: Path, results: list[Result], curve: list[tuple[int, float]], floor: float) -> Path | None:
    """DEMO/demo.png: loss by σ_rel, the best σ_rel's weight per checkpoint, raw checkpoints' losses."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, then run the demo again)")
        return None
    raw, ema = results[0], next((r for r in results if r.name == "EMA"), None)
    sweep = [r for r in results if r.sigma_rel is not None]
    best = min(sweep, key=lambda r: r.loss)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.4))

    sigmas = [r.sigma_rel for r in sweep]
    left.plot(sigmas, [r.loss for r in sweep], "o-", color="C0", label="post-hoc EMA (ema-ckpt posthoc)")
    left.plot([best.sigma_rel], [best.loss], "*", color="C0", markersize=16)
    left.axhline(raw.loss, color="C3", ls="--", label=f"{raw.name} (no averaging)")
    if ema is not None:
        left.axhline(ema.loss, color="C2", ls="-.", label=f"EMA ({ema.what.split(', ')[-1]})")
    left.axhline(floor, color="gray", ls=":", label="floor (the chain's own probabilities)")
    left.set_xscale("log")
    left.xaxis.set_minor_locator(NullLocator())
    left.set_xticks(sigmas, [f"{s:g}" for s in sigmas])
    left.set_xlabel("σ_rel (EMA length relative to training time)")
    left.set_ylabel("held-out loss")
    left.set_title("Held-out loss by EMA length")
    left.legend(fontsize=8)

    plan = plan_posthoc(demo / "ckpts", sigma_rels=[f"{best.sigma_rel:g}"]).outputs[0]
    steps, coeffs = [t.step for t in plan.terms], [t.coefficient for t in plan.terms]
    width = 0.8 * min((b - a for a, b in itertools.pairwise(steps)), default=1)
    middle.bar(steps, coeffs, width=width, color="C0", label=f"σ_rel {best.sigma_rel:g} (best post-hoc)")
    decay = ema_decay(Path(ema.path)) if ema is not None else None
    if decay is not None:
        ema_coeffs = exponential_coefficients(steps, ExponentialProfile(decay=decay))
        middle.step(steps, ema_coeffs, where="mid", color="C2", label="EMA (accumulate)")
    middle.set_xlabel("checkpoint step")
    middle.set_ylabel("coefficient (weights sum to 1)")
    middle.set_title("Weight of each checkpoint")
    middle.legend(fontsize=8)

    raw_steps, raw_losses = zip(*curve, strict=True)
    right.plot(raw_steps, raw_losses, "o-", color="C3", ms=3, label="raw checkpoints")
    right.axhline(best.loss, color="C0", label=f"σ_rel {best.sigma_rel:g}")
    if ema is not None:
        right.axhline(ema.loss, color="C2", ls="-.", label="EMA")
    right.axhline(floor, color="gray", ls=":", label="floor")
    right.set_xlabel("checkpoint step")
    right.set_ylabel("held-out loss")
    right.set_title("Raw checkpoints vs their averages (2nd half)")
    right.legend(fontsize=8)

    fig.tight_layout()
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
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp.load(no_dist=True)
    data = held_out(HELD_OUT)
    if args.check:
        return check(args.demo, args.check, data)

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
