"""Write the suite's shared checkpoint sequences into ``tests/fixtures/sequences``.

The FSDP1/FSDP2 sequences of ``tests/conftest.py``'s ``fsdp_sequence`` and the DeepSpeed runs of
``tests/ds_fixtures.py``'s ``ds_run``, each made by its real producer (torchrun + gloo on CPU:
``fsdp_train.py``, ``deepspeed_train.py``), exactly as those fixtures would make them in a session.
The fixtures read the committed copies; a configuration missing here is built in the session.
``tests/test_producers.py`` builds one sequence again and checks it against its committed copy.

Run from the repository root (``make fixtures`` does)::

    .venv/bin/python tests/producers/sequences.py --out tests/fixtures/sequences
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FSDP_STEPS = [3, 7, 20, 21, 30]
"""The steps each FSDP sequence saves (irregular on purpose)."""
FSDP_RUNS = [  # (kind, world size, dtype, with optimizer state): every configuration the suite asks for
    ("fsdp1", 2, "float32", False), ("fsdp1", 3, "float32", False), ("fsdp1", 3, "float32", True),
    ("fsdp2", 1, "float32", False), ("fsdp2", 2, "float32", False), ("fsdp2", 2, "float32", True),
    ("fsdp2", 2, "bfloat16", False), ("fsdp2", 3, "float32", False), ("fsdp2", 3, "float32", True),
    ("fsdp2", 4, "float32", False),
]
DEEPSPEED_WORLD_SIZES = [2, 3]
COMMITTED = REPO / "tests" / "fixtures" / "sequences"
"""Where the suite's copies are committed."""
INDEX = "index.json"
"""``{name: [checkpoint folders, relative to the name's folder]}`` of every sequence committed."""


def fsdp_name(kind: str, world_size: int, dtype: str = "float32", with_optim: bool = False) -> str:
    return f"{kind}-w{world_size}-{dtype}{'-optim' if with_optim else ''}"


def deepspeed_name(world_size: int) -> str:
    return f"deepspeed-w{world_size}"


def committed(name: str) -> list[Path] | None:
    """The committed sequence ``name`` (its checkpoint folders in :data:`COMMITTED`), or None."""
    index = COMMITTED / INDEX
    listed = json.loads(index.read_text()).get(name) if index.is_file() else None
    return [COMMITTED / name / rel for rel in listed] if listed is not None else None


def build_fsdp(out: Path, kind: str, world_size: int, dtype: str, with_optim: bool) -> list[Path]:
    from tests.producers.launch import make_fsdp_sequence

    return make_fsdp_sequence(out, kind=kind, world_size=world_size, steps=FSDP_STEPS, dtype=dtype,
                              with_optim=with_optim)


def build_deepspeed(out: Path, world_size: int) -> list[Path]:
    from tests.ds_fixtures import CONFIGS, STEPS
    from tests.producers.ds_launch import make_deepspeed_sequences

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    runs = [{"out": out / c.name, "stage": c.stage, "dtype": c.dtype, "bf16_optimizer": c.bf16_optimizer,
             "zero": dict(c.zero)} for c in CONFIGS if c.world_size == world_size]
    make_deepspeed_sequences(runs, world_size=world_size, steps=STEPS, timeout=600)
    return [out]


def main() -> None:
    from tests.producers.trainers.fixture_common import drop_deepspeed_scripts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    builds: dict[str, Callable[[Path], list[Path]]] = {
        fsdp_name(*run): (lambda d, run=run: build_fsdp(d, *run)) for run in FSDP_RUNS}
    builds.update({deepspeed_name(w): (lambda d, w=w: build_deepspeed(d, w)) for w in DEEPSPEED_WORLD_SIZES})
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    index = {}
    for name, build in builds.items():
        print(f"{name} ...", flush=True)
        index[name] = [str(p.relative_to(out / name)) for p in build(out / name)]
        drop_deepspeed_scripts(out / name)  # DeepSpeed's copies of its own converters: code, not data
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
