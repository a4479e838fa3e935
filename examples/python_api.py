"""ema-ckpt as a library: plan and fold an EMA, post-hoc EMAs, consolidate, verify.

    python examples/python_api.py ckpts/ out/      # ckpts/: a folder of checkpoints, e.g. from train_fsdp2.py

Writes, under OUT:

* ``ema/``: an EMA of the checkpoints (a DCP checkpoint); run again later, it folds in only the
  checkpoints saved since;
* ``posthoc/sigma_rel_<v>/``: post-hoc power-function EMAs (EDM2), one per ``--sigma-rel``;
* ``ema.safetensors``: the EMA as one file, keys as in ``model.state_dict()``.

Each function is the library behind a CLI command. Errors are ``EmaCkptError`` subclasses whose
``exit_code`` is the CLI's (75: another run holds the output's lock).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import load_file

import ema_ckpt
from ema_ckpt.commands.averaging import RunResult
from ema_ckpt.errors import EmaCkptError
from ema_ckpt.plans import Plan


def fold_ema(ckpts: Path, out: Path, decay: float) -> None:
    """Show the plan (metadata only), fold the checkpoints into ``out``, then see nothing is left."""
    plan = ema_ckpt.accumulate(ckpts, decay=decay, out=out, dry_run=True)
    print(f"plan: EMA at step {plan.step}, {plan.profile}")
    for term in plan.terms:
        print(f"  {term.coefficient:.5f} x step {term.step}  {term.path}")

    result = ema_ckpt.accumulate(ckpts, decay=decay, out=out, wait_seconds=60)
    if result.up_to_date:
        print(f"accumulate: {result.out} already at step {result.step}")
    else:
        steps = ", ".join(str(c.step) for c in result.folded)
        print(
            f"accumulate: folded step{'s' if len(result.folded) != 1 else ''} {steps} into {result.out}, "
            f"now at step {result.step} "
            f"({result.keys} keys, {result.bytes_read} bytes read, {result.bytes_written} written)"
        )

    again = ema_ckpt.accumulate(ckpts, decay=decay, out=out)
    print(f"accumulate again: up to date = {again.up_to_date}, step {again.step}")


def posthoc_emas(ckpts: Path, out: Path, sigma_rels: list[str]) -> list[Path]:
    """EDM2 post-hoc EMAs: the coefficients first, then one pass over the checkpoints for all of them."""
    plan = ema_ckpt.posthoc(ckpts, out=out, sigma_rels=sigma_rels, dry_run=True)
    assert isinstance(plan, Plan)
    for output in plan.outputs:
        terms = ", ".join(f"{t.coefficient:.4f} x step {t.step}" for t in output.terms)
        print(f"plan: {output.name} at step {output.step}: {terms}")

    run = ema_ckpt.posthoc(ckpts, out=out, sigma_rels=sigma_rels, overwrite=True)
    assert isinstance(run, RunResult)
    for path in run.outputs:
        print(f"posthoc: wrote {path}")
    return run.outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpts", type=Path, help="a folder of checkpoints (DCP, DeepSpeed, safetensors)")
    parser.add_argument("out", type=Path, help="where the outputs go")
    parser.add_argument("--decay", type=float, default=0.99, help="EMA decay per optimizer step")
    parser.add_argument("--sigma-rel", action="append", default=None, help="post-hoc σ_rel (repeatable)")
    args = parser.parse_args()
    sigma_rels = args.sigma_rel or ["0.05", "0.10"]
    ema_dir = args.out / "ema"

    fold_ema(args.ckpts, ema_dir, args.decay)
    posthoc_dirs = posthoc_emas(args.ckpts, args.out / "posthoc", sigma_rels)

    single = ema_ckpt.consolidate(ema_dir, args.out / "ema.safetensors", overwrite=True)
    state = load_file(single.out)  # plain tensors, ready for model.load_state_dict(state)
    print(f"consolidate: {single.out} ({single.layout}, {single.keys} tensors, {single.bytes_written} bytes)")
    name, tensor = next(iter(state.items()))
    print(f"  {name}: {tuple(tensor.shape)} {tensor.dtype}")

    for path in [ema_dir, *posthoc_dirs]:
        check = ema_ckpt.verify(path)
        status = "OK" if check.ok else "; ".join(check.problems)
        print(f"verify {path}: {status} ({check.keys} keys, {check.bytes_checked} bytes checked)")
        if not check.ok:
            sys.exit(3)


if __name__ == "__main__":
    try:
        main()
    except EmaCkptError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
