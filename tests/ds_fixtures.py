"""Real DeepSpeed ZeRO checkpoint sequences for tests, and DeepSpeed's own zero_to_fp32 as oracle.

DeepSpeed is a test-only producer and oracle; ema-ckpt never imports it.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ema_ckpt.storage import open_readable
from ema_ckpt.torch_records.zipfmt import stored_members
from tests.producers import sequences
from tests.shared_dirs import built_once

STEPS = [2, 3, 7]


@dataclass(frozen=True)
class Config:
    world_size: int
    stage: int
    dtype: str
    bf16_optimizer: bool = False
    zero: tuple[tuple[str, object], ...] = ()  # extra zero_optimization settings

    @property
    def name(self) -> str:
        extra = "-bf16opt" if self.bf16_optimizer else ""
        extra += "".join(f"-{k.split('_')[0]}" for k, _ in self.zero)
        return f"z{self.stage}-{self.dtype}{extra}-w{self.world_size}"


# All stages × both dtypes at W=2; at W=3 (odd: every partition boundary moves) stages 1 and 3,
# stage 2 in bf16, stage 2 with round-robin gradient order and 16-byte parameter alignment
# (gaps between params in the flat group), and DeepSpeed's BF16_Optimizer (which zero_to_fp32
# refuses to read).
CONFIGS = [Config(2, s, d) for s in (1, 2, 3) for d in ("fp32", "bf16")] + [
    Config(3, 1, "fp32"),
    Config(3, 2, "bf16"),
    Config(3, 3, "bf16"),
    Config(3, 2, "fp32", zero=(("round_robin_gradients", True), ("parameter_alignment", True))),
    Config(3, 1, "bf16", bf16_optimizer=True),
]
ZERO_TO_FP32_CONFIGS = [c for c in CONFIGS if not c.bf16_optimizer]


def _require_deepspeed() -> None:
    """Skip unless DeepSpeed imports (it is the producer and oracle only, never the reader's)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:  # absent, or present but broken: skip either way
        pytest.skip(f"needs DeepSpeed to produce fixtures / as the oracle ({err})")


@pytest.fixture(scope="session")
def ds_run(tmp_path_factory):
    """``ds_run(config)`` → the save folder (``latest`` + ``global_step{2,3}``) of that run.

    All configurations of one world size are trained in a single torchrun launch: the copy
    committed in ``tests/fixtures/sequences`` (``tests/producers/sequences.py``), else once per
    session.
    """
    _require_deepspeed()
    roots: dict[int, Path] = {}

    def get(config: Config) -> Path:
        world = config.world_size
        if world not in roots:
            name = sequences.deepspeed_name(world)
            [roots[world]] = sequences.committed(name) or built_once(
                tmp_path_factory, name, lambda root: sequences.build_deepspeed(root, world))
        return roots[world] / config.name

    return get


@pytest.fixture(scope="session")
def zero_to_fp32():
    """``zero_to_fp32(folder, tag)`` → DeepSpeed's own reconstruction (cached)."""
    _require_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    cache: dict[tuple[Path, str], dict[str, torch.Tensor]] = {}

    def get(folder: Path, tag: str) -> dict[str, torch.Tensor]:
        if (folder, tag) not in cache:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                cache[folder, tag] = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)
        return cache[folder, tag]

    return get


def members_read(tag: Path, reader) -> tuple[list[tuple[Path, int, int]], list[tuple[Path, int, int]]]:
    """(zip members a run reads, members it never touches) of the tag folder's ``.pt`` files, each
    (file, data start, size), those of 8 KiB or more; ``reader`` is the tag's ``DeepSpeedReader``."""
    read = reader.data_ranges()
    touched, untouched = [], []
    for file in sorted(tag.glob("*.pt")):
        with open_readable(file) as source:
            members = stored_members(source, source.size) or {}
        for start, (size, _crc, _name) in members.items():
            if size < 8192:  # too small to hold a whole page of damage
                continue
            hit = any(f == file and a < start + size and start < a + n for f, a, n in read)
            (touched if hit else untouched).append((file, start, size))
    return touched, untouched
