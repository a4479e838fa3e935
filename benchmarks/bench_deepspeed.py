"""accumulate and consolidate over a real DeepSpeed ZeRO-3 sequence, beside cat and zero_to_fp32.

Usage: python benchmarks/bench_deepspeed.py [--data bench-data/zero3-1g] [--repeat 3]
Generates the sequence first if missing (benchmarks/make_deepspeed_sequence.py: 3 CPU ranks,
fp32, 272M parameters, 4 checkpoints at irregular steps; a few minutes and ~12 GiB of RAM once).

Measured side by side in one run, medians of ``--repeat``:

- ``cat`` of every file of the 4 tag folders, and ``python -c 'import torch'``: the floor;
- ``dd conv=fsync`` of as many bytes as the EMA holds: what writing the output durably costs
  on this disk (accumulate fsyncs its output before publishing it);
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/zero3-1g"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-zero-to-fp32", action="store_true")
    args = parser.parse_args()
    here = Path(__file__).parent
    subprocess.run([PY, str(here / "make_deepspeed_sequence.py"), str(args.data)], check=True,
                   stdout=subprocess.DEVNULL)
    sys.path.insert(0, str(here.parent))
    from ema_ckpt.formats.deepspeed import deepspeed_tags

    tags = deepspeed_tags(args.data)
    newest = tags[-1]
    input_bytes = sum(dir_bytes(t) for t in tags)
    out_root = args.data.parent / "bench-out-deepspeed"
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir()
    files = " ".join(str(f) for t in tags for f in sorted(t.iterdir()))
    runs = {
        "cat inputs > /dev/null": dict(cmd=f"cat {files} > /dev/null", shell=True),
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
    from ema_ckpt.formats import open_checkpoint

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
    floor = results["cat inputs > /dev/null"].wall_median + results["python -c 'import torch'"].wall_median
    ema = results[f"ema-ckpt accumulate ({len(tags)} steps)"]
    rows = [(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()]
    print(f"Machine: {machine_description()}")
    print(f"Input: {args.data}, DeepSpeed ZeRO-3, {len(tags)} steps ({', '.join(t.name for t in tags)}), "
          f"{input_bytes / 2**30:.2f} GiB in all; medians of {args.repeat} runs, hot page cache\n")
    print(table(rows, ("command", "wall s", "peak RSS MiB")))
    write = results["dd output-sized file, conv=fsync"].wall_median
    print(f"\naccumulate / (cat + import torch) = {ema.wall_median / floor:.2f}")
    print(f"accumulate / (cat + import torch + dd conv=fsync) = {ema.wall_median / (floor + write):.2f}")
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
