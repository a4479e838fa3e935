"""accumulate over N fp32 DCP checkpoints on an S3-compatible server on loopback, against its floor.

The server is moto's (``ThreadedMotoServer``, started here); the checkpoints are generated
locally (benchmarks/make_dcp_sequence.py) and uploaded once. The floor reads the same
objects with s3fs (``cat``, every object at once) in one process, plus writing the output's
bytes once, durably; ``python -c 'import torch'`` is shown beside it.

Usage: python benchmarks/bench_s3.py [--data bench-data/dcp-256m] [--size-gib 0.25] [--count 4]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _harness import (
    EMA,
    PY,
    Measurement,
    dcp_sequence,
    dir_bytes,
    durable_writes,
    in_turn,
    machine_description,
    run_timed,
    table,
    write_floor,
)

BUCKET = "bench"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path("bench-data/dcp-256m"))
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import boto3
    from moto.server import ThreadedMotoServer

    ckpts = dcp_sequence(args.data, args.size_gib, args.count)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
               AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    os.environ.update(env)
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        keys = []
        for ckpt in ckpts:
            for file in sorted(ckpt.iterdir()):
                key = f"run/ckpts/{ckpt.name}/{file.name}"
                client.upload_file(str(file), BUCKET, key)
                keys.append(f"{BUCKET}/{key}")
        url = f"s3://{BUCKET}/run/ckpts"
        input_bytes = sum(dir_bytes(c) for c in ckpts)
        out_root = args.data.parent / "bench-s3-out"
        shutil.rmtree(out_root, ignore_errors=True)
        out_root.mkdir()
        out_mib = max(1, sum(int(p.stat().st_size) for p in ckpts[-1].iterdir()) >> 20)
        cat = ("import s3fs, sys; fs = s3fs.S3FileSystem(); "
               f"data = fs.cat({keys!r}); assert sum(map(len, data.values())) == {input_bytes}")
        put = ("import s3fs; fs = s3fs.S3FileSystem(); "
               f"fs.pipe_file('{BUCKET}/floor/out.bin', bytes({out_mib << 20}))")
        runs = {
            "s3fs cat of every object (one process, concurrent)": dict(cmd=[PY, "-c", cat]),
            "python -c 'import torch'": dict(cmd=[PY, "-c", "import torch"]),
            "write the output bytes once (dd, fsync)": dict(
                cmd=durable_writes(out_root / "dd", 1, out_mib, direct=False), shell=True),
            "write the output bytes once (dd, O_DIRECT, fsync)": dict(
                cmd=durable_writes(out_root / "dd", 1, out_mib, direct=True), shell=True),
            "ema-ckpt accumulate s3:// → local": dict(cmd=[EMA, "accumulate", url, "--decay", "0.999", "--out",
                                                          str(out_root / "ema"), "--quiet", "--restart"]),
            "s3fs put of the output bytes once": dict(cmd=[PY, "-c", put]),
            "ema-ckpt accumulate s3:// → s3://": dict(cmd=[EMA, "accumulate", url, "--decay", "0.999", "--out",
                                                          f"s3://{BUCKET}/run/ema", "--quiet", "--restart"]),
        }
        results = {name: Measurement(name, [], []) for name in runs}
        for repeat in range(args.repeat):
            for name, spec in in_turn(runs, repeat):
                for target in ("ema", "dd"):
                    shutil.rmtree(out_root / target, ignore_errors=True)
                wall, rss = run_timed(spec["cmd"], shell=spec.get("shell", False), env=env)
                results[name].wall.append(wall)
                results[name].rss_mib.append(rss)
    finally:
        server.stop()
    write, _ = write_floor(results, "write the output bytes once (dd, fsync)",
                           "write the output bytes once (dd, O_DIRECT, fsync)")
    floor = results["s3fs cat of every object (one process, concurrent)"].wall_median + write
    ema = results["ema-ckpt accumulate s3:// → local"]
    print(f"Machine: {machine_description()}")
    print(f"Inputs: {len(ckpts)} checkpoints, {input_bytes / 2**30:.2f} GiB on moto's S3 server (loopback); "
          f"medians of {args.repeat}")
    print(table([(m.name, f"{m.wall_median:.2f}", f"{m.rss_median:.0f}") for m in results.values()],
                ("run", "wall s", "peak RSS MiB")))
    print(f"floor (s3fs cat + the faster durable write): {floor:.2f} s")
    with_torch = floor + results["python -c 'import torch'"].wall_median
    print(f"accumulate from S3: {ema.wall_median:.2f} s, {ema.wall_median / floor:.2f}x its floor, "
          f"{ema.wall_median / with_torch:.2f}x the floor plus starting torch; peak RSS {ema.rss_median:.0f} MiB")
    both = results["ema-ckpt accumulate s3:// → s3://"]
    floor_both = (results["s3fs cat of every object (one process, concurrent)"].wall_median
                  + results["s3fs put of the output bytes once"].wall_median)
    print(f"accumulate S3 to S3: {both.wall_median:.2f} s, {both.wall_median / floor_both:.2f}x its floor "
          f"(s3fs cat + s3fs put of the output, {floor_both:.2f} s); peak RSS {both.rss_median:.0f} MiB")


if __name__ == "__main__":
    main()
