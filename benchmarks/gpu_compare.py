"""The comparison and the summary of ``benchmarks/gpu_check.sh``.

``compare`` reads two runs' outputs (a checkpoint, or a folder of them such as
``OUT/sigma_rel_<v>``) chunk by chunk and reports, per tensor, whether the two are
bit-identical or how many units in the last place (ulps) they differ by at most; it exits 1
when any tensor differs by more than ``--max-ulps``. ``summary`` turns the script's timings
and comparisons into a table and one JSON document.

Example:
    python benchmarks/gpu_compare.py compare --json-dir OUT --pair posthoc ph-cpu ph-cuda
    python benchmarks/gpu_compare.py summary --json-dir OUT --timings OUT/timings.tsv --device cuda \\
        --count 4 --size-gib 1
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _harness import machine_description

from ema_ckpt import open_checkpoint
from ema_ckpt._text import escaped
from ema_ckpt.errors import EmaCkptError

EXPECTED = (
    "bit-identical: each element goes through the same operations in the same order on both "
    "devices (a copy or a multiply for the first source, then one lerp_ or add_(alpha=w) per "
    "source, the scalar weight rounded to the accumulation dtype on both), and torch computes each "
    "with one fused multiply-add on both: the CPU kernels call vec::fmadd (lerp: "
    "fmadd(w or w-1, end-self, self or end); add: fmadd(other, alpha, self)) and nvcc contracts "
    "CUDA's self + w*(end-self), end - (end-self)*(1-w) and self + alpha*other into FMAs by default "
    "(--fmad=true); w-1 = -(1-w) exactly, so both branches give the same bits. The weighted sums "
    "are not reordered: each output element is its own sequence of updates, in source order."
)
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FAR = 2**62  # "more ulps than anyone cares to count": opposite signs or a NaN on one side only


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ulps between two float tensors of one dtype (int64).

    The bits are mapped to integers that order like the values (−0 and +0 both map to 0), so
    adjacent floats are 1 apart. Elements with equal bits are 0, a NaN facing anything else
    and a pair of opposite signs are reported as a huge distance.

    Example:
        >>> x = torch.tensor([1.0, -2.0])
        >>> ulps_apart(x, torch.nextafter(x, torch.tensor([2.0, -3.0]))).tolist()
        [1, 1]
    """
    view = _INT_VIEW[a.element_size()]
    ia, ib = a.view(view).to(torch.int64), b.view(view).to(torch.int64)
    magnitude = (1 << (8 * a.element_size() - 1)) - 1
    oa = torch.where(ia < 0, -(ia & magnitude), ia)
    ob = torch.where(ib < 0, -(ib & magnitude), ib)
    same_side = (oa >= 0) == (ob >= 0)
    distance = torch.where(same_side, (oa - ob).abs(), torch.full_like(oa, _FAR))
    distance = torch.where(torch.isnan(a) | torch.isnan(b), torch.full_like(oa, _FAR), distance)
    return torch.where(ia == ib, torch.zeros_like(oa), distance)


def compare_tensor(ref: Any, other: Any, key: str) -> dict[str, Any]:
    """One key of two open checkpoints: equal bits, or the largest distance in ulps."""
    spec, spec_other = ref.specs()[key], other.specs()[key]
    record: dict[str, Any] = {"key": escaped(key), "dtype": str(spec.dtype).removeprefix("torch."),
                              "numel": spec.numel}
    if (spec.shape, spec.dtype) != (spec_other.shape, spec_other.dtype):
        record.update(status="mismatch", detail=f"{spec.shape} {spec.dtype} against {spec_other.shape} "
                                                f"{spec_other.dtype}")
        return record
    differing, max_ulps, max_abs = 0, 0, 0.0
    for box in ref.layout(key):
        a, b = ref.read(key, box), other.read(key, box)
        if torch.equal(a.view(_INT_VIEW[a.element_size()]), b.view(_INT_VIEW[b.element_size()])):
            continue
        if not a.is_floating_point():
            differing += int((a != b).sum())
            max_ulps = _FAR
            continue
        distance = ulps_apart(a, b)
        differing += int((distance > 0).sum())
        max_ulps = max(max_ulps, int(distance.max()))
        finite = torch.isfinite(a) & torch.isfinite(b)
        if finite.any():
            max_abs = max(max_abs, float((a.double() - b.double()).abs()[finite].max()))
    record.update(status="identical" if differing == 0 else "differs", differing=differing, max_ulps=max_ulps,
                  max_abs_diff=max_abs)
    return record


class Unmatched(Exception):
    """Two runs whose outputs or keys are not the same set: nothing to compare."""


def checkpoints(root: Path) -> Iterator[tuple[str, Path]]:
    """``root`` itself when it holds a checkpoint, else each child folder that does (by name)."""
    if (root / ".metadata").exists():
        yield root.name, root
        return
    for child in sorted(root.iterdir()):
        if child.is_dir() and (child / ".metadata").exists():
            yield child.name, child


def compare_runs(name: str, ref_root: Path, other_root: Path, max_ulps: int) -> dict[str, Any]:
    """Every output of two runs, tensor by tensor (JSON-ready)."""
    ref_outputs, other_outputs = dict(checkpoints(ref_root)), dict(checkpoints(other_root))
    if not ref_outputs or sorted(ref_outputs) != sorted(other_outputs):
        raise Unmatched(f"{escaped(str(ref_root))} and {escaped(str(other_root))} do not hold the same outputs "
                        f"({sorted(ref_outputs)} against {sorted(other_outputs)})")
    outputs: list[dict[str, Any]] = []
    for output, ref_path in ref_outputs.items():
        with open_checkpoint(ref_path) as ref, open_checkpoint(other_outputs[output]) as other:
            keys, other_keys = sorted(ref.specs()), sorted(other.specs())
            if keys != other_keys:
                other_path = escaped(str(other_outputs[output]))
                raise Unmatched(f"{escaped(str(ref_path))}: its keys differ from {other_path}'s")
            tensors = [compare_tensor(ref, other, key) for key in keys]
        outputs.append({"output": escaped(output), "tensors": tensors})
    worst = max((t.get("max_ulps", _FAR) for o in outputs for t in o["tensors"]), default=0)
    passed = all(t["status"] != "mismatch" for o in outputs for t in o["tensors"]) and worst <= max_ulps
    return {"name": name, "max_ulps_allowed": max_ulps, "worst_ulps": worst, "passed": passed, "outputs": outputs}


def ulps_text(ulps: int) -> str:
    """``3 ulp``, or what a distance too large to count means."""
    return "a NaN, a sign or a shape apart" if ulps >= _FAR else f"{ulps} ulp"


def describe(result: dict[str, Any]) -> list[str]:
    """Lines for the terminal: one per output, then one per tensor that is not bit-identical."""
    lines = []
    for output in result["outputs"]:
        tensors = output["tensors"]
        same = sum(t["status"] == "identical" for t in tensors)
        lines.append(f"{result['name']} {output['output']}: {same} of {len(tensors)} tensors bit-identical")
        for t in tensors:
            if t["status"] == "mismatch":
                lines.append(f"  {t['key']}: {t['detail']}")
            elif t["status"] == "differs":
                lines.append(f"  {t['key']}: {t['differing']} of {t['numel']} elements differ, at most "
                             f"{ulps_text(t['max_ulps'])} (max |Δ| {t['max_abs_diff']:.3g})")
    verdict = "ok" if result["passed"] else "FAIL"
    lines.append(f"{result['name']}: {verdict} (worst {ulps_text(result['worst_ulps'])}, allowed "
                 f"{result['max_ulps_allowed']} ulp)")
    return lines


def cmd_compare(args: argparse.Namespace) -> int:
    passed = True
    for name, ref, other in args.pair:
        try:
            result = compare_runs(name, Path(ref), Path(other), args.max_ulps)
        except (Unmatched, EmaCkptError, OSError) as err:
            print(f"error: {name}: {escaped(str(err))}", file=sys.stderr)
            return 3
        (args.json_dir / f"compare-{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print("\n".join(describe(result)))
        passed = passed and result["passed"]
    return 0 if passed else 1


READ_FLOOR = "cat inputs (read floor)"


def read_timings(path: Path) -> dict[str, dict[str, Any]]:
    """``name<TAB>device<TAB>seconds<TAB>rc`` lines as {name: {device: [seconds, ...]}}."""
    out: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        name, device, seconds, rc = line.split("\t")
        runs = out.setdefault(name, {})
        runs.setdefault(device, []).append(float(seconds))
        if int(rc) != 0:
            runs["failed_rc"] = int(rc)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def timing_rows(timings: dict[str, dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """Per step: the fastest run on each device, DEV against the CPU and both against the read floor."""
    devices = list(dict.fromkeys(("cpu", device)))
    cat = min(timings.get(READ_FLOOR, {}).get("cpu", [0.0]))
    rows = []
    for name, runs in timings.items():
        if not any(dev in runs for dev in devices):
            continue  # a step of the check itself (generating inputs, comparing), not a timing
        row: dict[str, Any] = {"step": name}
        for dev in devices:
            row[f"{dev}_s"] = min(runs[dev]) if dev in runs else None
        if device != "cpu":
            row[f"{device}_over_cpu"] = _ratio(row[f"{device}_s"], row["cpu_s"])
        if name != READ_FLOOR:
            for dev in devices:
                row[f"{dev}_over_read_floor"] = _ratio(row[f"{dev}_s"], cat)
        rows.append(row | {"runs": runs})
    return rows


def table(rows: list[dict[str, Any]], device: str) -> list[str]:
    """The timing rows as aligned text columns."""
    columns = [("step", "step"), ("cpu s", "cpu_s"), (f"{device} s", f"{device}_s"),
               (f"{device}/cpu", f"{device}_over_cpu"), ("cpu/read", "cpu_over_read_floor"),
               (f"{device}/read", f"{device}_over_read_floor")]
    columns = list(dict.fromkeys(c for c in columns if any(r.get(c[1]) is not None for r in rows)))
    cells = [[h for h, _ in columns]]
    for r in rows:
        line = [r["step"] + (f" (exit {r['runs']['failed_rc']})" if "failed_rc" in r["runs"] else "")]
        line += ["" if r.get(k) is None else f"{r[k]:.2f}" for _, k in columns[1:]]
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip() for line in cells]


def cmd_summary(args: argparse.Namespace) -> int:
    device = args.device
    timings = read_timings(args.timings) if args.timings.exists() else {}
    rows = timing_rows(timings, device)
    others = [(name, sum(runs["-"])) for name, runs in timings.items() if "-" in runs]
    compared = [json.loads(p.read_text()) for p in sorted(args.json_dir.glob("compare-*.json"))]
    gpu = (torch.cuda.get_device_name(torch.device(device))
           if device.startswith("cuda") and torch.cuda.is_available() else None)
    passed = bool(compared) and all(c["passed"] for c in compared) and args.failed_step is None
    summary = {
        "passed": passed, "failed_step": args.failed_step, "device": device, "gpu": gpu,
        "machine": machine_description(), "cuda": torch.version.cuda,
        "inputs": {"count": args.count, "size_gib": args.size_gib, "dtype": "float32"},
        "accumulate_dtype": args.dtype, "repeat": args.repeat, "expected": EXPECTED, "elapsed_s": args.elapsed_s,
        "timings": rows, "other_steps_s": dict(others),
        "comparisons": [
            {k: c[k] for k in ("name", "passed", "worst_ulps", "max_ulps_allowed")}
            | {"outputs": [{"output": o["output"], "tensors": len(o["tensors"]),
                            "identical": sum(t["status"] == "identical" for t in o["tensors"]),
                            "not_identical": [t for t in o["tensors"] if t["status"] != "identical"]}
                           for o in c["outputs"]]}
            for c in compared],
    }
    (args.json_dir / "gpu_check.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{machine_description()}" + (f"; {gpu}, CUDA {torch.version.cuda}" if gpu else ""))
    print(f"inputs: {args.count} × {args.size_gib} GiB fp32 DCP checkpoints, accumulating in {args.dtype}; "
          f"seconds: fastest of {args.repeat} run(s), hot page cache")
    print("\n".join(table(rows, device)))
    print("other steps: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in others)
          + (f"; {args.elapsed_s} s in all" if args.elapsed_s is not None else ""))
    for c in compared:
        same = sum(t["status"] == "identical" for o in c["outputs"] for t in o["tensors"])
        total = sum(len(o["tensors"]) for o in c["outputs"])
        print(f"{c['name']}: {same} of {total} tensors bit-identical, worst {ulps_text(c['worst_ulps'])} "
              f"(allowed {c['max_ulps_allowed']} ulp): {'ok' if c['passed'] else 'FAIL'}")
    if args.failed_step:
        print(f"failed: {args.failed_step}")
    print(f"expected {EXPECTED.split(':', 1)[0]}; {'PASS' if passed else 'FAIL'}; summary in "
          f"{escaped(str(args.json_dir / 'gpu_check.json'))}")
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="compare runs' outputs tensor by tensor (OUT/compare-NAME.json)")
    compare.add_argument("--pair", nargs=3, action="append", required=True, metavar=("NAME", "REF", "OTHER"))
    compare.add_argument("--json-dir", type=Path, required=True)
    compare.add_argument("--max-ulps", type=int, default=0)
    summary = sub.add_parser("summary", help="the table, and OUT/gpu_check.json from the timings and comparisons")
    summary.add_argument("--timings", type=Path, required=True)
    summary.add_argument("--json-dir", type=Path, required=True)
    summary.add_argument("--device", required=True)
    summary.add_argument("--count", type=int, required=True)
    summary.add_argument("--size-gib", type=float, required=True)
    summary.add_argument("--dtype", default="float32")
    summary.add_argument("--repeat", type=int, default=1)
    summary.add_argument("--failed-step")
    summary.add_argument("--elapsed-s", type=int)
    args = parser.parse_args(argv)
    return cmd_compare(args) if args.command == "compare" else cmd_summary(args)


if __name__ == "__main__":
    sys.exit(main())
