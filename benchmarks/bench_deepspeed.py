"""accumulate and consolidate over a real DeepSpeed ZeRO-3 sequence, beside its floor and zero_to_fp32.

Usage: python benchmarks/bench_deepspeed.py [--data bench-data/zero3-adam-1g] [--repeat 3]
    [--ranks 2] [--optimizer adamw]
Generates the sequence first if missing (benchmarks/make_deepspeed_sequence.py: 2 CPU ranks,
fp32, 272M parameters, AdamW, so each optimizer file holds the fp32 masters and both Adam
moments; 4 checkpoints at irregular steps; about 5 minutes and ~12 GiB of RAM once).

Measured side by side in one run, medians of ``--repeat``:

- reading the bytes accumulate needs (the fp32 partitions of the optimizer files, never the
  Adam moments, and the small model-states files; ``DeepSpeedReader.data_ranges``) with
  ``pread`` into one buffer, and ``python -c 'import torch'``;
- ``dd conv=fsync`` of as many bytes as the EMA holds: what writing the output durably costs
  on this disk (accumulate fsyncs its output before publishing it). These three are the floor;
- ``ema-ckpt accumulate <save dir>`` over all 4 steps (a fresh EMA each run, ``--restart``);
- DeepSpeed's own ``convert_zero_checkpoint_to_fp32_state_dict`` for the newest step (one
  ``pytorch_model.bin``; DeepSpeed's safetensors path refuses the tied embedding);
- ``ema-ckpt consolidate`` of the newest step to one ``.safetensors`` file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (
    EMA,
    PY,
    Measurement,
    baseline_ratios,
    dir_bytes,
    in_turn,
    machine_description,
    run_timed,
    table,
    with_baseline,
)

ZERO_TO_FP32 = (
    "import sys\n"
    "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as convert\n"
    "convert(sys.argv[1], sys.argv[2], tag=sys.argv[3], max_shard_size=None)\n"
)

# Reads "path offset length" lines with pread into one 1 MiB buffer, as cat would (no torch).
READ_RANGES = (
    "import os, sys\n"
    "buf = memoryview(bytearray(1 << 20))\n"
    "for line in open(sys.argv[1]):\n"
    "    path, off, n = line.rsplit(' ', 2)\n"
    "    fd, off, end = os.open(path, os.O_RDONLY), int(off), int(off) + int(n)\n"
    "    while off < end:\n"
    "        off += os.preadv(fd, [buf[: min(len(buf), end - off)]], off)\n"
    "    os.close(fd)\n"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/zero3-adam-1g"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="world size, when the sequence is generated")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw",
                        help="client optimizer, when the sequence is generated")
    parser.add_argument("--skip-zero-to-fp32", action="store_true")
    args = parser.parse_args()
    here = Path(__file__).parent
    subprocess.run([PY, str(here / "make_deepspeed_sequence.py"), str(args.data), "--ranks", str(args.ranks),
                    "--optimizer", args.optimizer], check=True, stdout=subprocess.DEVNULL)
    sys.path.insert(0, str(here.parent))
    from ema_ckpt.formats.deepspeed import deepspeed_tags

    tags = deepspeed_tags(args.data)
    newest = tags[-1]
    input_bytes = sum(dir_bytes(t) for t in tags)
    out_root = args.data.parent / "bench-out-deepspeed"
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir()
    from ema_ckpt.formats import open_checkpoint

    ranges_file = Path(tempfile.mkstemp(prefix="ema-ckpt-bench-ranges-", suffix=".txt")[1])
    needed = 0
    with ranges_file.open("w") as fh:
        for tag in tags:
            with open_checkpoint(tag) as reader:
                for path, offset, length in reader.data_ranges():  # type: ignore[attr-defined]
                    fh.write(f"{path} {offset} {length}\n")
                    needed += length
    runs = {
        "read the fp32 partitions (pread)": dict(cmd=[PY, "-S", "-c", READ_RANGES, str(ranges_file)]),
        "python -c 'import torch'": dict(cmd=[PY, "-c", "import torch"]),
        f"ema-ckpt accumulate ({len(tags)} steps)": dict(
            cmd=[EMA, "accumulate", str(args.data), "--decay", "0.999", "--out", str(out_root / "ema"),
                 "--quiet", "--restart"]),
    }
    if not args.skip_zero_to_fp32:
        runs[f"DeepSpeed zero_to_fp32 ({newest.name} → .bin)"] = dict(
            cmd=[PY, "-c", ZERO_TO_FP32, str(args.data), str(out_root / "z2f"), newest.name],
            env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"})
    runs[f"ema-ckpt consolidate ({newest.name} → .safetensors)"] = dict(
        cmd=[EMA, "consolidate", str(newest), "-o", str(out_root / "x.safetensors"), "--quiet",
             "--overwrite"])
    # The EMA holds every key of the newest step in fp32, tied aliases included.
    with open_checkpoint(newest) as reader:
        output_bytes = sum(spec.numel * 4 for spec in reader.specs().values())
    mib = -(-output_bytes // 2**20)
    runs["dd output-sized file, conv=fsync"] = dict(
        cmd=f"dd if=/dev/zero of={out_root / 'dd.bin'} bs=1M count={mib} conv=fsync status=none", shell=True)
    runs = with_baseline(runs)
    results = {name: Measurement(name, [], []) for name in runs}
    for repeat in range(args.repeat):
        for name, spec in in_turn(runs, repeat):
            shutil.rmtree(out_root / "z2f", ignore_errors=True)
            (out_root / "dd.bin").unlink(missing_ok=True)
            # Flush what earlier commands wrote (untimed): on ext4 an fsync waits for every dirty
            # page in the journal transaction, so accumulate would pay for zero_to_fp32's output.
            os.sync()
            wall, rss = run_timed(spec["cmd"], shell=spec.get("shell", False), env=spec.get("env"))
            results[name].wall.append(wall)
            results[name].rss_mib.append(rss)
    ranges_file.unlink(missing_ok=True)
    read = results["read the fp32 partitions (pread)"].wall_median
    torch_start = results["python -c 'import torch'"].wall_median
    ema = results[f"ema-ckpt accumulate ({len(tags)} steps)"]
    rows = [(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()]
    print(f"Machine: {machine_description()}")
    print(f"Input: {args.data}, DeepSpeed ZeRO-3, {len(tags)} steps ({', '.join(t.name for t in tags)}), "
          f"{input_bytes / 2**30:.2f} GiB in all, {needed / 2**30:.2f} GiB of it fp32 partitions and model "
          f"states; medians of {args.repeat} runs, hot page cache\n")
    print(table(rows, ("command", "wall s", "peak RSS MiB")))
    write = results["dd output-sized file, conv=fsync"].wall_median
    floor = read + torch_start + write
    print(f"\nfloor = read the fp32 partitions + import torch + dd conv=fsync = {floor:.2f} s")
    print(f"accumulate / floor = {ema.wall_median / floor:.2f}")
    base = results.get(f"ema-ckpt accumulate ({len(tags)} steps) [baseline]")
    if base is not None:
        print(f"accumulate [baseline] / floor = {base.wall_median / floor:.2f}")
    z2f = results.get(f"DeepSpeed zero_to_fp32 ({newest.name} → .bin)")
    cons = results[f"ema-ckpt consolidate ({newest.name} → .safetensors)"]
    if z2f is not None:
        print(f"consolidate / zero_to_fp32 (one step): time {cons.wall_median / z2f.wall_median:.2f}, "
              f"peak RSS {cons.rss_median / z2f.rss_median:.2f}")
    print(f"EMA output: {dir_bytes(out_root / 'ema') / 2**30:.2f} GiB; accumulate peak RSS "
          f"{'under' if ema.rss_median < 900 else 'OVER'} the 900 MiB budget")

    if baseline_ratios(results):
        print("\n" + baseline_ratios(results))


if __name__ == "__main__":
    main()
