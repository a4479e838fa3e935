"""consolidate and reshard of a 1 GiB fp32 DCP checkpoint beside torch's dcp_to_torch_save.

Usage: python benchmarks/bench_consolidate.py [--data bench-data/dcp-1g] [--repeat 3]
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/dcp-1g"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    here = Path(__file__).parent
    subprocess.run([PY, str(here / "make_dcp_sequence.py"), str(args.data), "--count", "1"],
                   check=True, stdout=subprocess.DEVNULL)
    ckpt = sorted(p for p in args.data.iterdir() if p.name.startswith("step_"))[0]
    out = args.data.parent / "bench-out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    runs = {
        "torch dcp_to_torch_save": [PY, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch",
                                    str(ckpt), str(out / "torch.pt")],
        "ema-ckpt consolidate → .safetensors": [EMA, "consolidate", str(ckpt), "-o", str(out / "m.safetensors"),
                                                "--quiet", "--overwrite"],
        "ema-ckpt consolidate → HF shards (500MB)": [EMA, "consolidate", str(ckpt), "-o", f"{out / 'hf'}/",
                                                     "--max-shard-size", "500MB", "--quiet", "--overwrite"],
        "ema-ckpt consolidate → .pt": [EMA, "consolidate", str(ckpt), "-o", str(out / "m.pt"), "--quiet",
                                      "--overwrite"],
        "ema-ckpt reshard --world-size 8": [EMA, "reshard", str(ckpt), "-n", "8", "-o", str(out / "r8"),
                                            "--quiet", "--overwrite"],
    }
    specs = with_baseline({name: {"cmd": cmd} for name, cmd in runs.items()})
    results = {name: Measurement(name, [], []) for name in specs}
    for repeat in range(args.repeat):
        for name, spec in in_turn(specs, repeat):
            # every tool writes a fresh output: deleting the last run's gigabyte is not timed
            shutil.rmtree(out)
            out.mkdir()
            subprocess.run(["sync"], check=True)
            wall, rss = run_timed(spec["cmd"], env=spec.get("env"))
            results[name].wall.append(wall)
            results[name].rss_mib.append(rss)
    base = results["torch dcp_to_torch_save"]
    rows = [(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}", f"{m.wall_median / base.wall_median:.2f}",
             f"{m.rss_median / base.rss_median:.2f}") for m in results.values()]
    print(f"Machine: {machine_description()}")
    print(f"Input: {ckpt} ({dir_bytes(ckpt) / 2**30:.2f} GiB); medians of {args.repeat} runs, hot page cache\n")
    print(table(rows, ("command", "wall s", "peak RSS MiB", "time vs torch", "RSS vs torch")))

    if baseline_ratios(results):
        print("\n" + baseline_ratios(results))


if __name__ == "__main__":
    main()
