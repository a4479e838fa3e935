"""accumulate over N Lightning-style single files: wall time and peak RSS beside the hand-written loop.

Each file holds the model's ``state_dict`` (about ``--size-gib`` GiB of fp32 weights in 64 MiB
tensors) beside two Adam moments of the same size, the loop and callback state a Lightning
checkpoint carries, and an ``argparse.Namespace``: three times the model's bytes, of which an EMA
needs one. Rows, measured in turn:

- ``cat inputs``: reading every file once (more than accumulate needs: it never reads the moments);
- ``read the weights' bytes``: reading just the model's stored bytes, one ``pread`` per tensor
  (what accumulate must read), plus ``import torch``: the read floor;
- the hand-written loop users write: ``torch.load`` each whole file (``weights_only=False``: the
  Namespace), ``lerp_`` into a float32 copy, ``torch.save`` the EMA;
- ``ema-ckpt accumulate`` over the folder, with no flag.

Usage: python benchmarks/bench_single_files.py [--data bench-data/single-1g] [--count 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import EMA, PY, durable_writes, machine_description, measure_in_turn, table, write_floor

MAKE = """
import argparse, sys, torch
from pathlib import Path
out, size, count = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
out.mkdir(parents=True, exist_ok=True)
rows = 4096
tensors = max(1, int(size * 2**30 / (rows * 4096 * 4)))
g = torch.Generator().manual_seed(0)
for i in range(count):
    step = 100 * (i + 1)
    path = out / f"epoch={i}-step={step}.ckpt"
    if path.exists():
        continue
    state = {f"model.layers.{t}.weight": torch.randn(rows, 4096, generator=g) for t in range(tensors)}
    moments = [{t: torch.randn(rows, 4096, generator=g) for t in range(tensors)} for _ in range(2)]
    torch.save({"epoch": i, "global_step": step, "pytorch-lightning_version": "2.6.6", "state_dict": state,
                "optimizer_states": [{"state": {t: {"step": torch.tensor(float(step)), "exp_avg": moments[0][t],
                                                    "exp_avg_sq": moments[1][t]} for t in range(tensors)},
                                      "param_groups": [{"lr": 1e-3, "params": list(range(tensors))}]}],
                "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": i}}}},
                "hyper_parameters": {"args": argparse.Namespace(lr=1e-3)}}, path)
"""

HAND = """
import sys, torch
out, decay, files = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
ema, last = None, None
for file in files:
    ckpt = torch.load(file, weights_only=False, map_location="cpu")
    state, step = ckpt["state_dict"], ckpt["global_step"]
    if ema is None:
        ema = {k: v.float().clone() for k, v in state.items()}
    else:
        weight = 1 - decay ** (step - last)
        for k, v in state.items():
            ema[k].lerp_(v.float(), weight)
    last = step
    del ckpt, state
torch.save(ema, out)
"""

READ_WEIGHTS = """
import os, sys
from pathlib import Path
from ema_ckpt.formats import open_checkpoint
for file in sys.argv[1:]:
    with open_checkpoint(Path(file)) as reader:
        spans = [(t.data_offset + t.record.storage_offset * 4, t.record.storage_numel * 4)
                 for t in reader._tensors.values()]
    fd = os.open(file, os.O_RDONLY)
    buffer = bytearray(64 << 20)
    for offset, length in spans:
        done = 0
        while done < length:
            done += os.preadv(fd, [memoryview(buffer)[: min(len(buffer), length - done)]], offset + done)
    os.close(fd)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/single-1g"))
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    subprocess.run([PY, "-c", MAKE, str(args.data), str(args.size_gib), str(args.count)], check=True)
    files = sorted(args.data.glob("*.ckpt"), key=lambda p: int(p.stem.split("step=")[1]))[: args.count]
    out = args.data.parent / "bench-out-single"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    model_mib = int(args.size_gib * 1024)
    runs = {
        "cat inputs > /dev/null": dict(cmd=f"cat {' '.join(map(str, files))} > /dev/null", shell=True),
        "read the weights' bytes + import torch": dict(cmd=[PY, "-c", READ_WEIGHTS, *map(str, files)]),
        "write the output bytes once (dd, fsync)": dict(cmd=durable_writes(out / "dd", 1, model_mib, direct=False),
                                                        shell=True),
        "write the output bytes once (dd, O_DIRECT, fsync)": dict(
            cmd=durable_writes(out / "dd", 1, model_mib, direct=True), shell=True),
        "hand-written loop (torch.load + lerp_ + torch.save)": dict(
            cmd=[PY, "-c", HAND, str(out / "hand.pt"), "0.999", *map(str, files)]),
        "ema-ckpt accumulate": dict(cmd=[EMA, "accumulate", str(args.data), "--decay", "0.999", "--out",
                                         str(out / "ema"), "--quiet", "--restart"]),
    }
    results = measure_in_turn(runs, out / "ema", args.repeat)
    write, _ = write_floor(results, "write the output bytes once (dd, fsync)",
                           "write the output bytes once (dd, O_DIRECT, fsync)")
    floor = results["read the weights' bytes + import torch"].wall_median + write
    ema = results["ema-ckpt accumulate"]
    hand = results["hand-written loop (torch.load + lerp_ + torch.save)"]
    total = sum(f.stat().st_size for f in files)
    print(f"Machine: {machine_description()}")
    print(f"Input: {len(files)} single files, {total / 2**30:.2f} GiB in all ({args.size_gib:g} GiB of weights "
          f"each); medians of {args.repeat} runs, hot page cache\n")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("command", "wall s", "peak RSS MiB")))
    print(f"\nfloor (the weights' bytes read + import torch + the faster durable write) = {floor:.2f} s; "
          f"accumulate / floor = {ema.wall_median / floor:.2f}")
    print(f"accumulate / hand-written: time {ema.wall_median / hand.wall_median:.2f}, "
          f"peak RSS {ema.rss_median / hand.rss_median:.2f}")


if __name__ == "__main__":
    main()
