"""What the trainer-fixture producers share."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""DeepSpeed copies its own converter scripts into every save folder; they are code, not data,
and are not kept in the fixtures (nothing reads them)."""


def drop_deepspeed_scripts(set_dir: Path) -> list[str]:
    """Remove DeepSpeed's converter-script copies from a set; the note that says so."""
    removed = [p for name in DEEPSPEED_SCRIPTS for p in set_dir.rglob(name)]
    for path in removed:
        path.unlink()
    if not removed:
        return []
    return [f"removed {len(removed)} copies of DeepSpeed's {'/'.join(DEEPSPEED_SCRIPTS)} (code, not data)"]


TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip
"""An outer launcher's variables, kept out of the producers' own torchrun launches."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_producer(description: str, sets: Sequence[str], workers: Mapping[str, Callable[[str, Path], None]],
                 produce: Callable[[str, Path], Path], argv: list[str] | None = None) -> int:
    """A producer script's command line: ``--set all|a,b --out DIR``, each set produced in turn
    (a failure reported and the others produced), or one ``--worker`` run (under torchrun)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--set", default="all", help=f"'all' or comma-separated names of: {', '.join(sets)}")
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/trainers"))
    parser.add_argument("--worker", choices=sorted(workers), help=argparse.SUPPRESS)
    parser.add_argument("--set-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        workers[args.worker](args.set, args.set_dir)
        return 0
    names = list(sets) if args.set == "all" else [s.strip() for s in args.set.split(",") if s.strip()]
    unknown = [n for n in names if n not in sets]
    if unknown:
        parser.error(f"unknown set(s) {unknown}; choose from {list(sets)} or 'all'")
    failures = []
    for name in names:
        print(f"[{name}] producing ...", flush=True)
        try:
            set_dir = produce(name, args.out)
        except Exception as exc:  # report and go on with the other sets
            failures.append(name)
            print(f"[{name}] FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"[{name}] done: {set_dir}", flush=True)
    if failures:
        print(f"failed sets: {failures}", file=sys.stderr)
        return 1
    return 0


def package_versions(names: Sequence[str]) -> dict[str, str | None]:
    """Python's, torch's and each named distribution's version (None when not installed), safetensors'
    included: what a set's ``producer.json`` records."""
    import importlib.metadata as md
    import platform

    import torch

    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in [*names, "safetensors"]:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def write_oracle(path: Path, tensors: dict, tool: str) -> None:
    """A safetensors file of a state dict (tensors detached, on CPU, cloned and contiguous: tied weights
    become two tensors), its metadata exactly ``{"tool": tool}``, mode 0644."""
    import torch
    from safetensors.torch import save_file

    out = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{path.name}: {key} is {type(value).__name__}, not a tensor")
        out[key] = value.detach().to("cpu").clone().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    # One metadata entry only: safetensors writes the metadata map in hash order, so two keys
    # would make the bytes of the file vary from run to run.
    save_file(out, str(path), metadata={"tool": tool})
    path.chmod(0o644)  # safetensors creates 0600 files


def torch_file_facts(path: Path) -> dict:
    """A torch.save file's top-level keys (None when not a dict), unsafe globals, whether
    torch.load(weights_only=True) takes it (torch's allowlist only), and its size."""
    import torch

    obj = torch.load(path, map_location="cpu", weights_only=False)
    try:
        torch.load(path, map_location="cpu", weights_only=True)
        weights_only_ok = True
    except Exception:  # pickle.UnpicklingError naming the first global outside the allowlist
        weights_only_ok = False
    return {
        "top_level_keys": list(obj.keys()) if isinstance(obj, dict) else None,
        "unsafe_globals": sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path))),
        "weights_only_loads": weights_only_ok,
        "bytes": path.stat().st_size,
    }


def optimizer_step_of(optimizer_state: dict) -> int:
    """torch AdamW's per-parameter 'step', which must be the same for every parameter."""
    steps = {int(s["step"]) for s in optimizer_state["state"].values()}
    if len(steps) != 1:
        raise RuntimeError(f"optimizer steps differ between parameters: {steps}")
    return steps.pop()


def optimizer_steps(opt_sd: dict) -> list:
    """The distinct AdamW 'step' values in an optimizer state dict (per-parameter state), sorted."""
    steps = set()
    for st in opt_sd.get("state", {}).values():
        if isinstance(st, dict) and "step" in st:
            s = st["step"]
            steps.add(float(s) if hasattr(s, "item") else s)
    return sorted(steps)


def fresh_set_dir(out: Path, set_name: str) -> Path:
    """``out/set_name`` resolved, emptied of an earlier run and created."""
    set_dir = (out / set_name).resolve()
    if set_dir.exists() or set_dir.is_symlink():
        shutil.rmtree(set_dir)
    set_dir.mkdir(parents=True)
    return set_dir


RETRY_MARKERS = ("address already in use", "eaddrinuse", "terminate called without an active exception")
"""A torchrun launch's output that asks for one more try: a port taken between picking and binding it,
or gloo's rare abort at process teardown on a loaded machine."""


def run_worker(cmd: list[str], *, env: Mapping[str, str], cwd: Path | None, label: str, timeout: float,
               retry_markers: Sequence[str] = ()) -> bool:
    """Run one worker command in its own session, stdout and stderr together: True when it exits 0, False
    when it fails with one of ``retry_markers`` in its (lower-cased) output; any other failure, or a run
    past ``timeout`` seconds (its process group killed), raises RuntimeError naming ``label``."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RuntimeError(f"{label} timed out after {timeout}s\n{(output or '')[-6000:]}") from None
    output = output or ""
    if proc.returncode == 0:
        return True
    if any(m in output.lower() for m in retry_markers):
        return False
    raise RuntimeError(f"{label} failed (exit {proc.returncode})\n{output[-8000:]}")
