"""Per-tensor cost: checkpoints of many small tensors (a mixture-of-experts export's shape).

Three checkpoints of N fp32 tensors of 16 bytes each (keys like
``model.layers.3.mlp.experts.117.w1``), as safetensors folders, as DCP checkpoints and as a
DeepSpeed ZeRO-3 run (``deepspeed``: N parameters of 4 elements trained by DeepSpeed itself on 2
CPU ranks and saved after steps 1, 2 and 3; ``deepspeed_many_params.py``). For each N,
ema-ckpt's commands beside their floor: **one Python process that loads the same checkpoints
with the format's own loader, folds them, and saves one result** (``safetensors.torch.load_file``/
``save_file``; ``dcp.load``/``dcp.save``; DeepSpeed's
``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` per tag, then
``safetensors.torch.save_file``). The data is nothing (3 MiB at 200k tensors); what grows is the
cost per tensor, in time and in memory. For DeepSpeed, a row also gives what importing
DeepSpeed's ``zero_to_fp32`` alone costs, part of its floor.

DeepSpeed's own set-up is per parameter, so its checkpoints are slow to make (on 2 cores about
20 s for 1,000 parameters, 1 min for 5,000, 4.5 min for 20,000): its counts default to
``--deepspeed-counts``, and ``--counts`` (when given) applies to every format. Generated
checkpoints stay under ``--root`` (``many-<format>-<N>``) for the next run; the format is
skipped, with a note, where DeepSpeed does not import.

Usage: python benchmarks/bench_many_tensors.py [--counts 1000,10000,50000,200000]
       [--deepspeed-counts 1000,5000,20000] [--formats safetensors,dcp,deepspeed] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import EMA, PY, machine_description, measure_in_turn, table, with_baseline

_MAKE = """
import os, sys, warnings
import numpy as np
warnings.filterwarnings("ignore")
fmt, count, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
for step in (100, 200, 300):
    names = [f"layers.{i // 4000}.mlp.experts.{(i // 4) % 1000}.w{i % 4}" for i in range(count)]
    values = {n: rng.standard_normal(4).astype(np.float32) for n in names}
    folder = os.path.join(root, f"step_{step}")
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        os.makedirs(folder, exist_ok=True)
        save_file({"model." + n: v for n, v in values.items()}, os.path.join(folder, "model.safetensors"))
    else:
        import torch, torch.distributed.checkpoint as dcp
        dcp.save({"model": {n: torch.from_numpy(v) for n, v in values.items()}}, checkpoint_id=folder, no_dist=True)
"""

_FLOOR = """
import glob, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_grad_enabled(False)  # zero_to_fp32's tensors are views of a tensor that requires grad
fmt, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
pattern = "global_step*" if fmt == "deepspeed" else "step_*"
folders = sorted(glob.glob(os.path.join(root, pattern)), key=lambda p: int(p.rsplit("step", 1)[1].lstrip("_")))
ema = None
for folder in folders:
    if fmt == "safetensors":
        from safetensors.torch import load_file
        state = load_file(os.path.join(folder, "model.safetensors"))
    elif fmt == "deepspeed":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(root, tag=os.path.basename(folder))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        meta = FileSystemReader(folder).read_metadata()
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                 if hasattr(m, "size")}
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    if ema is None:
        ema = {k: v.clone() for k, v in state.items()}
    else:
        for k, v in state.items():
            ema[k].lerp_(v, 0.1)
os.makedirs(out, exist_ok=True)
if fmt in ("safetensors", "deepspeed"):
    from safetensors.torch import save_file
    save_file(ema, os.path.join(out, "model.safetensors"))
else:
    import torch.distributed.checkpoint as dcp
    dcp.save(ema, checkpoint_id=out, no_dist=True)
"""


DEFAULT_COUNTS = "1000,10000,50000,200000"
DEFAULT_DEEPSPEED_COUNTS = "1000,5000,20000"
NEWEST = {"safetensors": "step_300", "dcp": "step_300", "deepspeed": "global_step3"}
DS_ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
generated: dict[tuple[str, int], float | None] = {}
"""(format, count) → seconds its checkpoints took to generate in this run; None: already there."""


def _deepspeed_imports() -> bool:
    import subprocess

    probe = subprocess.run([PY, "-c", "import deepspeed.utils.zero_to_fp32"], env={**os.environ, **DS_ENV},
                           capture_output=True)
    return probe.returncode == 0


def _data(root: Path, fmt: str, count: int) -> Path:
    folder = root / f"many-{fmt}-{count}"
    if fmt == "deepspeed":
        from deepspeed_many_params import make

        took = make(folder, count)
        generated[fmt, count] = took or None
        return folder
    if not (folder / "step_300").exists():
        shutil.rmtree(folder, ignore_errors=True)
        import subprocess

        started = time.perf_counter()
        subprocess.run([PY, "-c", _MAKE, fmt, str(count), str(folder)], check=True)
        generated[fmt, count] = time.perf_counter() - started
    else:
        generated[fmt, count] = None
    return folder


def case(root: Path, fmt: str, count: int, repeat: int) -> list[tuple[str, ...]]:
    data = _data(root, fmt, count)
    out = root / "bench-many-out"
    ema = out / "ema"
    floor_env = DS_ENV if fmt == "deepspeed" else None
    runs = {
        "floor: load 3, fold, save 1": dict(cmd=[PY, "-c", _FLOOR, fmt, str(data), str(ema)], env=floor_env),
        "accumulate": dict(cmd=[EMA, "accumulate", str(data), "--decay", "0.9", "--out", str(ema), "--quiet"]),
        "inspect (newest)": dict(cmd=[EMA, "inspect", str(data / NEWEST[fmt]), "--json"]),
        "posthoc σ_rel 0.1": dict(cmd=[EMA, "posthoc", str(data), "--sigma-rel", "0.1", "--out", str(out / "ph"),
                                       "--quiet"]),
    }
    if fmt == "deepspeed":
        # the DeepSpeed reader on consolidate (the EMA's row below reads accumulate's DCP output)
        runs["consolidate (newest)"] = dict(cmd=[EMA, "consolidate", str(data / NEWEST[fmt]), "--out",
                                                 str(out / "n.safetensors"), "--overwrite", "--quiet"])
        # how much of the floor is importing DeepSpeed (not a command of ema-ckpt's)
        runs["(floor's part: import zero_to_fp32)"] = dict(cmd=[PY, "-c", "import deepspeed.utils.zero_to_fp32"],
                                                          env=floor_env)
    results = measure_in_turn(with_baseline(runs), out, repeat)
    # verify and consolidate need an EMA to read: one made once, outside the timed rows
    shutil.rmtree(out, ignore_errors=True)
    import subprocess

    subprocess.run([EMA, "accumulate", str(data), "--decay", "0.9", "--out", str(ema), "--quiet"], check=True)
    after = measure_in_turn(with_baseline({
        "verify (the EMA)": dict(cmd=[EMA, "verify", str(ema), "--quiet"]),
        "consolidate (the EMA)": dict(cmd=[EMA, "consolidate", str(ema), "--out", str(out / "c.safetensors"),
                                           "--overwrite", "--quiet"]),
    }), out / "c.safetensors", repeat)
    shutil.rmtree(out, ignore_errors=True)
    floor = results["floor: load 3, fold, save 1"]
    rows = []
    for name, m in {**results, **after}.items():
        rows.append((fmt, f"{count:,}", name, f"{m.wall_median:.2f}", f"{m.wall_median / floor.wall_median:.2f}",
                     f"{m.rss_median:.0f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=Path("bench-data"))
    parser.add_argument("--counts", help=f"tensor counts of every format (default {DEFAULT_COUNTS}; DeepSpeed's: "
                        "--deepspeed-counts)")
    parser.add_argument("--deepspeed-counts", default=DEFAULT_DEEPSPEED_COUNTS,
                        help="parameter counts of the DeepSpeed runs, where --counts is not given")
    parser.add_argument("--formats", default="safetensors,dcp,deepspeed")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(f"Machine: {machine_description()}; medians of {args.repeat} runs")
    rows: list[tuple[str, ...]] = []
    for fmt in args.formats.split(","):
        if fmt not in NEWEST:
            parser.error(f"unknown format {fmt!r} (one of {', '.join(NEWEST)})")
        if fmt == "deepspeed" and not _deepspeed_imports():
            print("deepspeed: skipped, `import deepspeed.utils.zero_to_fp32` fails here (pip install deepspeed)")
            continue
        counts = args.counts or (args.deepspeed_counts if fmt == "deepspeed" else DEFAULT_COUNTS)
        for count in (int(c) for c in counts.split(",")):
            new = case(args.root, fmt, count, args.repeat)
            rows.extend(new)
            print(table(new, ("format", "tensors", "command", "wall s", "× floor", "peak RSS MiB")), flush=True)
    print("\n### All\n")
    print(table(rows, ("format", "tensors", "command", "wall s", "× floor", "peak RSS MiB")))
    print("\nGenerating the checkpoints: " + ", ".join(
        f"{fmt} {count:,}: " + (f"{took:.0f} s" if took is not None else "already there")
        for (fmt, count), took in generated.items()))


if __name__ == "__main__":
    main()
