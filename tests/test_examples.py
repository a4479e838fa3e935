"""Every example in examples/, run end to end on CPU (gloo, 2 processes) with small sizes.

The outcomes are checked against independent oracles: torch's own DCP reader
(``dcp_to_torch_save``) and DeepSpeed's ``zero_to_fp32`` give the raw weights, and the EMA /
post-hoc results must equal the weighted sums of those.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.torchrun import launcher_env
from tests.torchrun import torchrun as launch

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
BIN = Path(sys.executable).parent
EMA_CKPT = str(BIN / "ema-ckpt")
DECAY = 0.9
FSDP2_STEPS = [20, 30, 40, 50]  # saved every 10 steps up to 50; --keep 4 deleted step_10
Weights = dict[str, torch.Tensor]



def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher or SLURM variables; the venv's commands first on PATH."""
    env = {k: v for k, v in launcher_env().items() if not k.startswith("SLURM_")}
    env.update(DS_ACCELERATOR="cpu", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env or clean_env(), cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def torchrun(script: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 script args``, which must succeed."""
    proc = launch([str(script), *args], env=clean_env(), timeout=timeout)
    assert proc.returncode == 0, f"{script.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc


def load_dcp(path: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, read by torch itself."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    scratch.mkdir(parents=True, exist_ok=True)
    file = scratch / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, file)
    state = torch.load(file, weights_only=True)
    return state.get("model", state)


def ema_oracle(states: list[tuple[int, Weights]], decay: float) -> Weights:
    """EMA with ``decay`` per optimizer step over (step, weights) in step order, from the first."""
    (prev, first), *rest = states
    ema = {k: v.double() for k, v in first.items()}
    for step, state in rest:
        w = 1.0 - decay ** (step - prev)
        ema = {k: (1 - w) * ema[k] + w * state[k].double() for k in ema}
        prev = step
    return ema


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key].double(), value.double(), rtol=1e-5, atol=1e-6, msg=key)


def log_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def fsdp2_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/train_fsdp2.py: 50 steps on 2 CPU ranks, a checkpoint every 10, the newest 4 kept."""
    out = tmp_path_factory.mktemp("fsdp2") / "ckpts"
    proc = torchrun(
        EXAMPLES / "train_fsdp2.py", "--out", str(out), "--steps", "50", "--save-every", "10", "--keep", "4"
    )
    assert "step 50: loss" in proc.stdout
    return out


@pytest.fixture(scope="module")
def fsdp2_weights(fsdp2_ckpts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Weights]:
    scratch = tmp_path_factory.mktemp("fsdp2-oracle")
    return {s: load_dcp(fsdp2_ckpts / f"step_{s}", scratch) for s in FSDP2_STEPS}


def test_readme_names_every_example() -> None:
    readme = (EXAMPLES / "README.md").read_text()
    for path in EXAMPLES.rglob("*"):
        name = path.relative_to(EXAMPLES).as_posix()
        if (
            path.is_file()
            and name != "README.md"
            and "__pycache__" not in name
            and not path.name.startswith(".")
        ):
            assert f"`{name}`" in readme, f"examples/README.md does not mention {name}"


@pytest.mark.slow
def test_train_fsdp2_saves_dcp_checkpoints(fsdp2_ckpts: Path, fsdp2_weights: dict) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from ema_ckpt.commands.verify import verify

    assert sorted(p.name for p in fsdp2_ckpts.iterdir()) == [f"step_{s}" for s in FSDP2_STEPS]  # --keep 4
    for step in FSDP2_STEPS:
        ckpt = fsdp2_ckpts / f"step_{step}"
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        roots = {key.split(".")[0] for key in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata}
        assert roots == {"model", "optim"}
    assert "blocks.0.fc1.weight" in fsdp2_weights[50]
    assert not torch.equal(fsdp2_weights[20]["head.weight"], fsdp2_weights[50]["head.weight"])  # it trained
    assert verify(fsdp2_ckpts / "step_50").ok


@pytest.mark.slow
def test_cron_script(fsdp2_ckpts: Path, fsdp2_weights: dict, tmp_path: Path) -> None:
    from ema_ckpt.storage.local_publish import OutputLock

    script = EXAMPLES / "cron" / "ema_cron.sh"
    assert run(["bash", "-n", str(script)]).returncode == 0
    assert any("* * * *" in line for line in script.read_text().splitlines()[:5])  # the crontab line
    ckpts, ema = tmp_path / "ckpts", tmp_path / "ckpts" / "ema"
    env = clean_env(EMA_CKPT=EMA_CKPT, EMA_DECAY=str(DECAY), EMA_WAIT="0", PYTHON=sys.executable)

    def cron(*args: str) -> subprocess.CompletedProcess[str]:
        return run(["bash", str(script), *(args or [str(ckpts)])], env=env)

    def arrive(*steps: int) -> None:
        for s in steps:
            shutil.copytree(fsdp2_ckpts / f"step_{s}", ckpts / f"step_{s}")

    arrive(20, 30)
    first = cron()
    assert first.returncode == 0, first.stderr
    assert len(log_lines(first)) == 1 and "ok: folded steps 20,30; EMA at step 30" in first.stdout
    files = {p.name: p.read_bytes() for p in ema.iterdir()}

    again = cron()  # nothing new: exit 0, no byte changed
    assert again.returncode == 0 and log_lines(again)[0].endswith("ok: up to date at step 30")
    assert {p.name: p.read_bytes() for p in ema.iterdir()} == files

    arrive(40, 50)  # training saved two more and retention deleted the two the EMA holds
    shutil.rmtree(ckpts / "step_20")
    shutil.rmtree(ckpts / "step_30")
    (ckpts / "step_60").mkdir()  # and is still writing the next one (DCP writes .metadata last)
    shutil.copy(fsdp2_ckpts / "step_50" / "__0_0.distcp", ckpts / "step_60")
    third = cron()
    assert third.returncode == 0 and len(log_lines(third)) == 1
    assert "ok: folded steps 40,50; EMA at step 50" in third.stdout
    assert f"[skipped {ckpts / 'step_60'}: " in third.stdout
    assert run([EMA_CKPT, "verify", str(ema)]).returncode == 0
    assert_close(
        load_dcp(ema, tmp_path / "scratch"), ema_oracle([(s, fsdp2_weights[s]) for s in FSDP2_STEPS], DECAY)
    )

    with OutputLock(ema):  # another run holds the EMA: exit 75, one line, nothing written
        busy = cron()
    assert busy.returncode == 75 and len(log_lines(busy)) == 1 and "busy:" in busy.stdout

    missing = cron(str(tmp_path / "no-such-folder"))
    assert missing.returncode == 3 and "error (exit 3)" in missing.stdout and "no such file" in missing.stdout


def _posthoc_oracle(result: dict, weights: dict[int, Weights], out: Path, scratch: Path) -> None:
    """Each output equals Σ coefficient × checkpoint for the coefficients it reports."""
    from ema_ckpt.commands.verify import verify

    for output in result["outputs"]:
        coeffs = {t["step"]: t["coefficient"] for t in output["terms"]}
        assert sorted(coeffs) == FSDP2_STEPS and sum(coeffs.values()) == pytest.approx(1.0)
        path = out / output["name"]
        assert verify(path).ok
        expected = {k: sum(c * weights[s][k].double() for s, c in coeffs.items()) for k in weights[50]}
        assert_close(load_dcp(path, scratch), expected)


@pytest.mark.slow
def test_slurm_posthoc_without_slurm(fsdp2_ckpts: Path, fsdp2_weights: dict, tmp_path: Path) -> None:
    script = EXAMPLES / "slurm" / "posthoc.sbatch"
    out = tmp_path / "posthoc"
    proc = run(["bash", str(script), str(fsdp2_ckpts), str(out), "0.05,0.10"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # rank 0's JSON document only
    assert [o["name"] for o in result["outputs"]] == ["sigma_rel_0.05", "sigma_rel_0.10"]
    assert sorted(p.name for p in out.iterdir()) == ["sigma_rel_0.05", "sigma_rel_0.10"]
    _posthoc_oracle(result, fsdp2_weights, out, tmp_path / "scratch")


def test_slurm_posthoc_under_slurm_launches_one_torchrun_per_node(tmp_path: Path) -> None:
    """Under SLURM: srun starts torchrun with the job's node count and a c10d rendezvous on the first node."""
    script = EXAMPLES / "slurm" / "posthoc.sbatch"
    text = script.read_text()
    assert "#SBATCH --nodes=" in text and "#SBATCH --time=" in text
    assert run(["bash", "-n", str(script)]).returncode == 0
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in {
        "scontrol": 'printf "node-a\\nnode-b\\n"',
        "srun": 'echo "srun $*"',
    }.items():
        (fake / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (fake / name).chmod(0o755)
    env = clean_env(SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_JOB_NODELIST="node-[a-b]")
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    proc = run(["bash", str(script), "/shared/ckpts", "/shared/posthoc", "0.05"], env=env)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("srun ") and " torchrun " in line
    assert "--nnodes 2" in line and "--rdzv-endpoint node-a:29500" in line and "--rdzv-id 4242" in line
    command = "-m ema_ckpt posthoc /shared/ckpts --sigma-rel 0.05 --out /shared/posthoc --json --quiet"
    assert line.endswith(command)


@pytest.mark.slow
def test_python_api(fsdp2_ckpts: Path, fsdp2_weights: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "out"
    proc = run(
        [sys.executable, str(EXAMPLES / "python_api.py"), str(fsdp2_ckpts), str(out), "--decay", str(DECAY)],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "plan: EMA at step 50" in text
    assert "accumulate: folded steps 20, 30, 40, 50" in text
    assert "accumulate again: up to date = True, step 50" in text
    assert "plan: sigma_rel_0.05 at step 50" in text and "plan: sigma_rel_0.10 at step 50" in text
    assert text.count("verify ") == 3 and text.count(": OK (") == 3
    # the dry-run plan's coefficients are those of the oracle: (1-w) products of 0.9^10 per gap
    a = DECAY**10
    assert f"{a * a * a:.5f} x step 20" in text and f"{1 - a:.5f} x step 50" in text

    expected = ema_oracle([(s, fsdp2_weights[s]) for s in FSDP2_STEPS], DECAY)
    assert_close(load_file(out / "ema.safetensors"), expected)  # keys without the "model." prefix
    assert_close(load_dcp(out / "ema", tmp_path / "scratch"), expected)
    assert sorted(p.name for p in (out / "posthoc").iterdir()) == ["sigma_rel_0.05", "sigma_rel_0.10"]


def _zero_to_fp32(folder: Path, tag: str) -> dict[str, torch.Tensor]:
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "dtype"), [(1, "bf16"), (3, "fp32")])
def test_train_deepspeed_then_accumulate(
    stage: int, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs DeepSpeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # for zero_to_fp32, the oracle, in this process
    out = tmp_path / "ds"
    torchrun(
        EXAMPLES / "train_deepspeed.py",
        "--out",
        str(out),
        "--stage",
        str(stage),
        "--dtype",
        dtype,
        "--steps",
        "20",
        "--save-every",
        "10",
    )
    assert (out / "latest").read_text().strip() == "global_step20"
    assert sorted(p.name for p in out.glob("global_step*")) == ["global_step10", "global_step20"]

    proc = run([EMA_CKPT, "accumulate", str(out), "--decay", str(DECAY), "--json"])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [c["step"] for c in result["folded"]] == [10, 20] and result["step"] == 20
    assert run([EMA_CKPT, "verify", str(out / "ema")]).returncode == 0

    weights = [(s, _zero_to_fp32(out, f"global_step{s}")) for s in (10, 20)]
    assert_close(load_dcp(out / "ema", tmp_path / "scratch"), ema_oracle(weights, DECAY))
