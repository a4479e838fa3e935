"""`make demo` (examples/demo.sh) end to end, with a short training run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "demo.sh"
SIGMAS = ["0.05", "0.1", "0.2"]


def demo_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, with a short training run."""
    launcher = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(DEMO_STEPS="120", DEMO_SAVE_EVERY="20", DEMO_SIGMAS=",".join(SIGMAS), COLUMNS="140")
    env.update(extra)
    return env


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
    assert "Held-out loss" in text and "raw step_120" in text and "EMA" in text and "σ_rel 0.1 " in text

    steps = sorted(int(p.name.split("_")[1]) for p in (out / "ckpts").iterdir())
    assert steps == [20, 40, 60, 80, 100, 120]
    assert (out / "ema" / ".metadata").is_file()
    for sigma in SIGMAS:
        assert (out / "posthoc" / f"sigma_rel_{sigma}" / ".metadata").is_file()
    results = json.loads((out / "results.json").read_text())
    names = [r["name"] for r in results["results"]]
    assert names[0] == "raw step_120" and "EMA" in names
    assert all(f"σ_rel {s:g}" in names for s in map(float, SIGMAS))
    assert all(math.isfinite(r["loss"]) for r in results["results"])
    assert results["best"]["loss"] == min(r["loss"] for r in results["results"])
    assert (out / "best").read_text().strip() == results["best"]["path"]

    # the best weights, shipped: both give the same held-out loss as their source
    assert (out / "best.safetensors").is_file()
    files = sorted(p.name for p in (out / "best-4ranks").glob("*.distcp"))
    assert files == [f"__{rank}_0.distcp" for rank in range(4)]
    assert text.count(", the same as ") == 2

    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot: {out}/demo.png" in text

    # without matplotlib: the table still, no plot, and a message saying why
    blocked = tmp_path / "no-matplotlib"
    (blocked / "matplotlib").mkdir(parents=True)
    (blocked / "matplotlib" / "__init__.py").write_text("raise ImportError('blocked for this test')\n")
    (out / "demo.png").unlink(missing_ok=True)
    again = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo" / "evaluate.py"), str(out)],
        env=demo_env(PYTHONPATH=str(blocked)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Held-out loss" in again.stdout and "matplotlib is not installed" in again.stdout
    assert not (out / "demo.png").exists()
