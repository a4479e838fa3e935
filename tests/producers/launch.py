"""Launch ``fsdp_train.py`` under torchrun (gloo, CPU) to make real FSDP checkpoint sequences."""

from __future__ import annotations

from pathlib import Path

from tests.torchrun import free_port, torchrun

__all__ = ["free_port", "make_fsdp_sequence"]

TRAIN_SCRIPT = Path(__file__).resolve().parent / "fsdp_train.py"

def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def make_fsdp_sequence(
    out: Path,
    *,
    kind: str,
    world_size: int,
    steps: list[int],
    dtype: str = "float32",
    with_optim: bool = False,
    name_format: str = "step_{step}",
    seed: int = 0,
    timeout: float = 300,
    optim: str = "adamw",
    rank_local_metadata: bool = False,
) -> list[Path]:
    """Train a tiny model with FSDP1/FSDP2 on ``world_size`` CPU ranks and save DCP
    checkpoints after each optimizer step in ``steps`` into ``out / name_format.format(step=N)``.

    Returns the checkpoint directories sorted by step. Raises RuntimeError (with the
    tail of the captured output) if torchrun fails or a checkpoint is missing.
    """
    if kind not in ("fsdp1", "fsdp2"):
        raise ValueError(f"kind must be 'fsdp1' or 'fsdp2', not {kind!r}")
    if not steps:
        raise ValueError("steps must not be empty")
    out = Path(out)
    uniq = sorted({int(s) for s in steps})
    script_args = [
        str(TRAIN_SCRIPT),
        "--out", str(out),
        "--kind", kind,
        "--steps", ",".join(map(str, uniq)),
        "--dtype", dtype,
        "--name-format", name_format,
        "--seed", str(seed),
        "--optim", optim,
    ]  # fmt: skip
    if with_optim:
        script_args.append("--with-optim")
    if rank_local_metadata:
        script_args.append("--rank-local-metadata")

    proc = torchrun(script_args, nproc=world_size, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"torchrun failed with exit code {proc.returncode}: {' '.join(proc.args)}\n"
            f"--- stderr tail ---\n{_tail(proc.stderr)}\n--- stdout tail ---\n{_tail(proc.stdout, 2000)}"
        )

    dirs = [out / name_format.format(step=s) for s in uniq]
    meta_name = "__0.metadata" if rank_local_metadata else ".metadata"
    missing = [str(d) for d in dirs if not (d / meta_name).is_file()]
    if missing:
        raise RuntimeError(
            f"torchrun succeeded but checkpoints are missing: {missing}\n{_tail(proc.stdout, 2000)}"
        )
    return dirs
