"""Launch ``deepspeed_train.py`` under torchrun (gloo, CPU) to make real DeepSpeed ZeRO checkpoints.

Environment the runs get: ``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator; without oneCCL
installed its communication backend falls back to gloo), ``OMP_NUM_THREADS=1``, and no torchrun
variables inherited from an outer launcher. Nothing else is needed: ``LOCAL_SIZE`` and ``CCL_*``
only matter with oneCCL. The producer skips DeepSpeed's JIT-compiled shared-memory all-reduce,
so no compiler runs. On two cores: about 8 s of start-up per launch plus ~2 s per configuration
when several share a launch (:func:`make_deepspeed_sequences`).

Example:
    >>> from tests.producers.ds_launch import make_deepspeed_sequence  # doctest: +SKIP
    >>> folder = make_deepspeed_sequence(tmp, stage=3, world_size=2, dtype="bf16", steps=[2, 4])
    ... # doctest: +SKIP
    >>> sorted(p.name for p in folder.iterdir() if p.name.startswith("global_step"))
    ... # doctest: +SKIP
    ['global_step2', 'global_step4']
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from tests.producers.launch import _tail, free_port
except ImportError:  # run as a script from tests/producers
    from launch import _tail, free_port  # type: ignore[no-redef]

TRAIN_SCRIPT = Path(__file__).resolve().parent / "deepspeed_train.py"

_ADDR_IN_USE = ("address already in use", "eaddrinuse", "errno 98")
_TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip


def make_deepspeed_sequences(
    runs: list[dict],
    *,
    world_size: int,
    steps: list[int],
    timeout: float = 300,
    seed: int = 1234,
) -> list[Path]:
    """Train several configurations one after another in one torchrun launch.

    Each run is ``{"out": Path, "stage": 1|2|3, "dtype": "fp32"|"bf16", "bf16_optimizer": bool,
    "zero": {extra zero_optimization settings}}`` (the last two optional; benchmarks also pass
    ``"model": "big"``, ``"big_blocks"``, ``"optimizer": "sgd"`` and ``"oracles": False``, see
    ``deepspeed_train.py``)
    and gets a fresh model (same seed) and engine, saved with ``engine.save_checkpoint(out)`` after
    each global step in ``steps``. Returns the ``out`` folders, in the order given.

    Raises:
        RuntimeError: torchrun failed or a checkpoint is missing (with the output's tail).
    """
    if not runs:
        raise ValueError("runs must not be empty")
    if not steps:
        raise ValueError("steps must not be empty")
    uniq = sorted({int(s) for s in steps})
    for run in runs:
        if int(run["stage"]) not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, not {run['stage']!r}")
        if run.get("dtype", "fp32") not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be 'fp32' or 'bf16', not {run.get('dtype')!r}")
    outs = [Path(run["out"]) for run in runs]

    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore")

    with tempfile.TemporaryDirectory(prefix="ds-runs-") as tmp:
        runs_file = Path(tmp) / "runs.json"
        runs_file.write_text(json.dumps([{**run, "out": str(Path(run["out"]))} for run in runs]))
        for attempt in range(2):
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nproc-per-node", str(world_size),
                "--nnodes", "1",
                "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()),
                str(TRAIN_SCRIPT),
                "--runs", str(runs_file),
                "--steps", ",".join(map(str, uniq)),
                "--seed", str(seed),
            ]  # fmt: skip
            # A session of its own, so a timeout can stop torchrun *and* its worker processes.
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            try:
                stdout, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, _ = proc.communicate()
                raise RuntimeError(
                    f"DeepSpeed producer timed out after {timeout}s\n{_tail(stdout or '')}"
                ) from None
            output = stdout or ""
            if proc.returncode == 0:
                break
            if attempt == 0 and any(m in output.lower() for m in _ADDR_IN_USE):
                continue  # the free port was taken in between: try another
            raise RuntimeError(
                f"DeepSpeed producer failed (exit {proc.returncode}): {' '.join(cmd)}\n{_tail(output)}"
            )

    for out in outs:
        missing = [out / f"global_step{s}" for s in uniq if not (out / f"global_step{s}").is_dir()]
        latest = out / "latest"
        if missing or not latest.is_file():
            raise RuntimeError(f"DeepSpeed producer left no {missing or latest}\n{_tail(output)}")
    return outs


def make_deepspeed_sequence(
    out: Path,
    *,
    stage: int,
    world_size: int,
    dtype: str,
    steps: list[int],
    timeout: float = 300,
    bf16_optimizer: bool = False,
    zero_options: dict | None = None,
    seed: int = 1234,
) -> Path:
    """Train a tiny model with DeepSpeed ZeRO-``stage`` on ``world_size`` CPU ranks and save at ``steps``.

    The model has frozen parameters, an embedding tied to the output projection, a float and an
    integer buffer and LayerNorm; the optimizer is ``torch.optim.AdamW`` (two parameter groups).
    ``bf16_optimizer=True`` (with ``stage=1, dtype="bf16"``) selects DeepSpeed's BF16_Optimizer;
    ``zero_options`` adds ``zero_optimization`` settings (``round_robin_gradients``, ...).

    Returns:
        ``out``: the checkpoint folder holding ``latest`` and ``global_step<N>/`` for each step,
        plus the producer's oracles ``frozen_reference.pt`` and ``masters_step<N>.pt``.
    """
    run = {"out": out, "stage": stage, "dtype": dtype, "bf16_optimizer": bf16_optimizer, "zero": zero_options}
    return make_deepspeed_sequences([run], world_size=world_size, steps=steps, timeout=timeout, seed=seed)[0]
