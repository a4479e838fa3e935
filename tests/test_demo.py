"""`make demo` (examples/demo.sh) end to end with a short training run, and the demo's plot."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo.sh"
SIGMAS = ["0.05", "0.1", "0.2"]
# 100 steps: job 1 saves steps 20, 40 and 45 (its time limit); job 2 resumes and saves 50…100,
# keeping the newest 6, so every checkpoint of job 1 is deleted before cron run 2.
SHORT = {"DEMO_STEPS": "100", "DEMO_FIRST_JOB": "45", "DEMO_SAVE_EVERY": "20,10", "DEMO_KEEP": "6"}
JOB_1, JOB_2 = [20, 40, 45], [50, 60, 70, 80, 90, 100]


def demo_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, with a short training run."""
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(SHORT, DEMO_SIGMAS=",".join(SIGMAS), COLUMNS="140")
    env.update(extra)
    return env


def section(text: str, title: str) -> str:
    """The demo's output under the ``== title…`` line, up to the next section."""
    start = text.index(f"\n== {title}")
    end = text.find("\n== ", start + 1)
    return text[start : end if end >= 0 else None]


@pytest.mark.slow
def test_demo(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        ["bash", str(DEMO), sys.executable, str(out)],
        env=demo_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    for command in ("inspect", "accumulate", "posthoc", "consolidate", "reshard"):
        assert f"$ ema-ckpt {command} " in text
    assert "Held-out loss" in text and "raw step_100" in text and "EMA" in text and "σ_rel 0.1 " in text

    # the cron story: job 1 stops at its time limit, cron run 1, job 2 resumes and its retention deletes
    # job 1's checkpoints, cron run 2 folds only the new ones, cron run 3 has nothing to do
    assert "stopped at step 45 (the job's time limit)" in text and "resumed from step_45" in text
    assert "retention (the newest 6 kept) deleted step_20, step_40, step_45" in text
    assert sorted(int(p.name.split("_")[1]) for p in (out / "ckpts").glob("step_*")) == JOB_2
    run_1 = section(text, "cron run 1")
    assert "ema: folded steps 20, 40, 45; EMA now at step 45 " in run_1
    run_2 = section(text, "cron run 2")
    assert "--dry-run" in run_2 and "ema at step 100" in run_2
    assert "ema: folded steps 50, 60, 70, 80, 90, 100; EMA now at step 100 " in run_2
    assert "ema: up to date at step 100; nothing new to fold" in section(text, "cron run 3")
    manifest = json.loads((out / "ema" / "ema-ckpt.json").read_text())
    assert [c["step"] for c in manifest["checkpoints"]] == JOB_1 + JOB_2  # deleted ones included

    # checked at the end: the same bits as one run over every checkpoint, and a float64 EMA
    checks = section(text, "checks")
    assert "ema/ folded 9 checkpoints (steps 20 … 100); retention has deleted 3 of them since" in checks
    assert "the same bits in 30 of 30 tensors" in checks
    assert "(float32 rounding)" in checks and "DIFFERENT" not in checks

    assert (out / "ema" / ".metadata").is_file()
    for sigma in SIGMAS:
        assert (out / "posthoc" / f"sigma_rel_{sigma}" / ".metadata").is_file()
    results = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in results["results"]]
    assert names[0] == "raw step_100" and "EMA" in names
    assert all(f"σ_rel {s:g}" in names for s in map(float, SIGMAS))
    assert all(math.isfinite(r["loss"]) for r in results["results"])
    assert results["best"]["loss"] == min(r["loss"] for r in results["results"])
    assert (out / "best").read_text().strip() == results["best"]["path"]

    # the best weights, shipped: both give the same held-out loss as their source
    assert (out / "best.safetensors").is_file()
    files = sorted(p.name for p in (out / "best-4ranks").glob("*.distcp"))
    assert files == [f"__{rank}_0.distcp" for rank in range(4)]
    assert checks.count(", the same as ") == 2

    # select: the same held-out loss, computed by its own command on its own candidates
    assert "$ ema-ckpt select " in text and (out / "selected" / "model.safetensors").is_file()
    chosen = json.loads((out / "selected" / "ema-ckpt.json").read_text())["options"]["selected"]
    scores = {s["name"]: s["score"] for s in chosen["scores"]}
    assert chosen["score"] == min(scores.values()) and set(scores) >= {f"sigma_rel_{s}" for s in SIGMAS}
    by_sigma = {r["name"]: r["loss"] for r in results["results"]}
    for sigma in SIGMAS:  # the post-hoc outputs evaluate.py scored are the candidates select wrote
        assert scores[f"sigma_rel_{sigma}"] == pytest.approx(by_sigma[f"σ_rel {float(sigma):g}"], rel=1e-5)

    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot: {out}/demo.png" in text
        assert (out / "selected.select" / "scores.png").is_file()
        assert f"plot: {out}/selected.select/scores.png" in text


@pytest.fixture
def evaluate(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """examples/demo/evaluate.py as a module (it imports its sibling task.py)."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(REPO / "examples" / "demo"))
    spec = importlib.util.spec_from_file_location("demo_evaluate", REPO / "examples" / "demo" / "evaluate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_plot_panels_and_lines_are_labelled_and_apart(evaluate: ModuleType) -> None:
    """demo.png's four panels, every line and bar labelled, and no two lines of a panel drawn on top of
    each other, with the EMA and the best σ_rel 0.0016 apart (as in a real run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    result = evaluate.Result
    results = [
        result("raw step_400", "the last checkpoint, as saved", "ckpts/step_400", 1.4570),
        result("raw step_380", "the best raw checkpoint of the 2nd half", "ckpts/step_380", 1.4562),
        result("EMA", "ema-ckpt accumulate, half-life 20 steps", "ema", 1.4003),
        result("σ_rel 0.05", "ema-ckpt posthoc", "posthoc/sigma_rel_0.05", 1.4033, 0.05),
        result("σ_rel 0.1", "ema-ckpt posthoc", "posthoc/sigma_rel_0.1", 1.3987, 0.1),
        result("σ_rel 0.2", "ema-ckpt posthoc", "posthoc/sigma_rel_0.2", 1.4168, 0.2),
    ]
    curve = [(215, 1.63), (300, 1.51), (380, 1.4562), (400, 1.4570)]
    kept = [215, 220, 300, 380, 400]
    posthoc = evaluate.Weighting("σ_rel 0.1 (best post-hoc)", kept, [0.01, 0.01, 0.2, 0.3, 0.48])
    ema = evaluate.Weighting("EMA (accumulate)", [25, 200, *kept], [0.0, 0.0, 0.0, 0.0, 0.1, 0.3, 0.6])
    fig = evaluate.figure(results, curve, 1.3331, posthoc, ema, 215)
    try:
        axes = fig.get_axes()
        assert [ax.get_title() for ax in axes] == [
            "Held-out loss by EMA length",
            "Weight of each checkpoint",
            "Raw checkpoints against the best average (2nd half)",
            "Every variant (★ lowest)",
        ]
        left, weights, over_time, bars = axes
        legends = {ax.get_title(): [t.get_text() for t in ax.get_legend().get_texts()] for ax in axes[:3]}
        assert legends[left.get_title()] == [
            "post-hoc EMA (ema-ckpt posthoc)", "σ_rel 0.1: the sweep's lowest", "raw step_400 (no averaging)",
            "EMA (half-life 20 steps), on the right edge", "floor (the chain's own probabilities)",
        ]
        assert legends[weights.get_title()] == [
            "checkpoints deleted by retention (in the EMA)", "σ_rel 0.1 (best post-hoc)", "EMA (accumulate)",
        ]
        assert legends[over_time.get_title()] == [
            "raw checkpoints", "σ_rel 0.1: the lowest loss (every variant in the next panel)", "floor",
        ]
        for ax in axes[:3]:  # everything drawn is in the legend
            drawn = [a.get_label() for a in (*ax.get_lines(), *ax.containers, *ax.patches)]
            assert {label for label in drawn if not label.startswith("_")} <= set(legends[ax.get_title()])

        # no two lines on top of each other: horizontal lines at least 2% of the panel's height apart
        for ax in axes[:3]:
            bottom, top = ax.get_ylim()
            levels = sorted(float(line.get_ydata()[0]) for line in ax.get_lines()
                            if isinstance(line, Line2D) and len(set(line.get_ydata())) == 1
                            and len(line.get_ydata()) == 2)
            for a, b in itertools.pairwise(levels):
                assert b - a >= 0.02 * (top - bottom), (ax.get_title(), levels)

        # the two averaging methods' bars sit side by side, not on top of each other
        posthoc_x = {round(p.get_x() + p.get_width() / 2, 6) for p in weights.containers[0]}
        ema_x = {round(p.get_x() + p.get_width() / 2, 6) for p in weights.containers[1]}
        assert not posthoc_x & ema_x

        # one labelled bar per variant, in the table's order, the lowest starred
        top_down = sorted(zip(bars.get_yticks(), bars.get_yticklabels(), strict=True), key=lambda t: -t[0])
        assert [label.get_text() for _, label in top_down] == [
            "raw step_400", "raw step_380", "EMA", "σ_rel 0.05", "★ σ_rel 0.1", "σ_rel 0.2",
        ]
        assert [t.get_text() for t in bars.texts] == [f"{r.loss:.4f}" for r in results]
        assert len(bars.patches) == len(results)
    finally:
        plt.close(fig)


def test_no_plot_without_matplotlib(evaluate: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Without matplotlib the demo still prints its table; the plot is left out, with a message saying why."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert evaluate.plot(tmp_path, [], [], 1.0) is None
    assert "matplotlib is not installed: no plot" in capsys.readouterr().out
    assert not (tmp_path / "demo.png").exists()
