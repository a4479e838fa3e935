"""benchmarks/gpu_check.sh on the CPU (its device run is a second CPU run), its comparison, and
the ``--device`` check that runs before any work.

The script is meant for a GPU machine; here it must pass comparing the CPU with itself
(bit-identical), and its comparison must find and size the differences it exists to catch.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ema_ckpt.engine import check_device
from ema_ckpt.errors import OptionError
from tests.dcp_helpers import write_dcp

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _compare_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_compare", REPO / "benchmarks" / "gpu_compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_compare = _compare_module()


def _script(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), "--python", sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.slow  # nine Python processes, each starting torch: about 30-50 s on a 2-core machine
def test_gpu_check_passes_cpu_against_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _script("--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"), "--size-gib", "0.001",
                   "--count", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["passed"] and summary["failed_step"] is None and summary["device"] == "cpu"
    by_name = {c["name"]: c for c in summary["comparisons"]}
    assert sorted(by_name) == ["accumulate", "accumulate-continued", "posthoc"]
    for comparison in by_name.values():
        assert comparison["worst_ulps"] == 0
        assert all(o["identical"] == o["tensors"] > 0 and not o["not_identical"] for o in comparison["outputs"])
    assert len(by_name["posthoc"]["outputs"]) == 8  # the K = 8 sweep
    assert [o["output"] for o in by_name["accumulate"]["outputs"]] == ["sigma_rel_0.05", "sigma_rel_0.25"]
    steps = {row["step"]: row for row in summary["timings"]}
    assert list(steps) == ["cat inputs (read floor)", "start torch", "accumulate (2 EMAs)", "posthoc K=8"]
    assert len(steps["posthoc K=8"]["runs"]["cpu"]) == 2  # the reference run and the "device" run
    assert steps["posthoc K=8"]["cpu_over_read_floor"] > 0
    assert list(summary["other_steps_s"]) == ["generate inputs", "compare accumulate", "compare posthoc",
                                              "start an EMA on the CPU", "continue it on cpu",
                                              "compare accumulate-continued"]
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["ckpts-0.001g-3"], "outputs are removed, inputs kept"


def test_gpu_check_stops_at_its_deadline_and_still_summarises(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = _script("--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work"), "--deadline", "1",
                   timeout=60)
    assert proc.returncode == 3, proc.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert not summary["passed"] and summary["failed_step"] == "generate inputs (-): no time left before the deadline"
    assert "FAIL" in proc.stdout.splitlines()[-1]


def test_gpu_check_refuses_a_missing_device_in_one_line(tmp_path: Path) -> None:
    proc = _script("--device", "cuda:0", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                   timeout=120)
    if proc.returncode == 0 or torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device cuda:0" in lines[0] and "sees no such device" in lines[0], proc.stderr
    assert not (tmp_path / "work" / "ckpts-1g-4").exists(), "no input is generated for a device that is not there"


@pytest.mark.parametrize("args, message", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--count", "1"], "--count must be an integer ≥ 2"),
    (["--size-gib", "big"], "--size-gib must be a number"),
    (["--max-ulps", "-1"], "--max-ulps must be a whole number"),
])  # fmt: skip
def test_gpu_check_usage_errors(args: list[str], message: str, tmp_path: Path) -> None:
    proc = _script(*args, "--out", str(tmp_path / "out"), timeout=30)
    assert proc.returncode == 2
    assert message in proc.stderr


def _nudged(t: torch.Tensor, steps: int, where: slice) -> torch.Tensor:
    """``t`` with the elements at ``where`` moved ``steps`` floats up (towards +inf)."""
    out = t.clone()
    for _ in range(steps):
        out[where] = torch.nextafter(out[where], torch.tensor(float("inf"), dtype=t.dtype))
    return out


def test_compare_sizes_differences_in_ulps(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = {f"model.{name}": torch.randn(8, 6, generator=g) for name in ("same", "one", "three")}
    base["model.step"] = torch.tensor(7)
    other = dict(base, **{"model.one": _nudged(base["model.one"], 1, slice(0, 2)),
                          "model.three": _nudged(base["model.three"], 3, slice(5, 8))})
    for run, tensors in (("ref", base), ("dev", other)):
        write_dcp(tmp_path / run / "ema", tensors, world_size=2)  # two chunks per tensor, compared one by one
    pair = ["--pair", "accumulate", str(tmp_path / "ref"), str(tmp_path / "dev")]

    assert gpu_compare.main(["compare", "--json-dir", str(tmp_path), "--max-ulps", "2", *pair]) == 1
    result = json.loads((tmp_path / "compare-accumulate.json").read_text())
    tensors = {t["key"]: t for t in result["outputs"][0]["tensors"]}
    assert result["worst_ulps"] == 3 and not result["passed"]
    assert tensors["model.same"]["status"] == tensors["model.step"]["status"] == "identical"
    assert (tensors["model.one"]["max_ulps"], tensors["model.one"]["differing"]) == (1, 2 * 6)
    assert (tensors["model.three"]["max_ulps"], tensors["model.three"]["differing"]) == (3, 3 * 6)
    assert 0 < tensors["model.three"]["max_abs_diff"] < 1e-5
    lines = gpu_compare.describe(result)
    assert any(line.startswith("  model.three: 18 of 48 elements differ, at most 3 ulp") for line in lines)
    assert lines[-1] == "accumulate: FAIL (worst 3 ulp, allowed 2 ulp)"

    assert gpu_compare.main(["compare", "--json-dir", str(tmp_path), "--max-ulps", "3", *pair]) == 0


def test_compare_refuses_outputs_that_do_not_match(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_dcp(tmp_path / "ref" / "sigma_rel_0.05", {"model.w": torch.ones(3)})
    write_dcp(tmp_path / "dev" / "sigma_rel_0.10", {"model.w": torch.ones(3)})
    assert gpu_compare.main(["compare", "--json-dir", str(tmp_path), "--pair", "posthoc", str(tmp_path / "ref"),
                             str(tmp_path / "dev")]) == 3  # not a result: the script stops
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: posthoc: ") and "do not hold the same outputs" in err and "\n" not in err
    write_dcp(tmp_path / "shape" / "sigma_rel_0.05", {"model.w": torch.ones(4)})
    assert gpu_compare.main(["compare", "--json-dir", str(tmp_path), "--pair", "posthoc", str(tmp_path / "ref"),
                             str(tmp_path / "shape")]) == 1
    assert "model.w: (3,) torch.float32 against (4,) torch.float32" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_ulps_apart(dtype: torch.dtype) -> None:
    tiny = torch.finfo(dtype).smallest_normal
    a = torch.tensor([1.0, -2.0, 0.0, tiny, 1.0, float("nan"), float("nan"), float("inf")], dtype=dtype)
    b = torch.tensor([1.0, -2.0, -0.0, -tiny, 1.0, 1.0, float("nan"), float("inf")], dtype=dtype)
    b[0] = torch.nextafter(a[0], torch.tensor(2.0, dtype=dtype))
    b[1] = torch.nextafter(torch.nextafter(a[1], torch.tensor(-3.0, dtype=dtype)), torch.tensor(-3.0, dtype=dtype))
    far = gpu_compare._FAR
    assert gpu_compare.ulps_apart(a, b).tolist() == [1, 2, 0, far, 0, far, 0, 0]


@pytest.mark.parametrize("device", ["cudax", "cuda:", "cuda:-1", "cuda:0 "])
def test_device_strings_torch_cannot_parse_are_option_errors(device: str) -> None:
    with pytest.raises(OptionError, match=r"must be cpu, cuda or cuda:N") as err:
        check_device(device)
    assert err.value.option == "device"


def test_a_gpu_index_past_the_last_is_an_option_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # the machine's GPU count is what is stubbed here, not any format: the check runs before any allocation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda")
    check_device("cuda:0")
    with pytest.raises(OptionError, match=r"cuda:1: this machine has 1 CUDA device \(cuda:0\)$"):
        check_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(OptionError, match=r"8 CUDA devices \(cuda:0 to cuda:7\)"):
        check_device("cuda:8")


def test_cli_names_a_malformed_device_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from ema_ckpt.cli import app

    write_dcp(tmp_path / "ckpts" / "step_10", {"model.w": torch.ones(3)})
    result = CliRunner().invoke(app, ["accumulate", str(tmp_path / "ckpts"), "--decay", "0.9", "--device", "cuda:x",
                                      "--out", str(tmp_path / "ema")])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --device must be cpu, cuda or cuda:N, got 'cuda:x'"
