"""A tiny ``transformers.Trainer`` run with :class:`~ema_ckpt.integrations.transformers.EmaCkptCallback`:
run by the tests in process, and by itself under torchrun (2 CPU ranks, gloo, DDP).

Each save's ``model.safetensors`` is loaded (in process) or copied to ``--record`` (under torchrun)
by a callback placed before ours, so the tests can build a float64 EMA of the states as saved.

    torchrun --nproc-per-node 2 tests/callback_train_hf.py --out-dir RUN --ema EMA --record SAVED --report R
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

VOCAB, SEQ = 64, 8


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token rows as ``{"input_ids", "labels"}`` (labels = inputs: the model shifts)."""

    def __init__(self, n: int = 64) -> None:
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


class RecordSaves(TrainerCallback):
    """At each save (before ema-ckpt's callback sees it), the new checkpoint's weights: in memory,
    or copied into ``into``; ``damage``: steps whose model.safetensors is then truncated."""

    def __init__(self, into: Path | None = None, damage: tuple[int, ...] = ()) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.into = into
        self.damage = damage

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        weights = Path(args.output_dir) / f"checkpoint-{state.global_step}" / "model.safetensors"
        if self.into is not None:
            self.into.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(weights, self.into / f"step-{state.global_step}.safetensors")
        else:
            self.states[state.global_step] = load_file(weights)
        if state.global_step in self.damage:
            size = weights.stat().st_size
            with open(weights, "r+b") as f:
                f.truncate(size // 2)


def training_args(out_dir: Path, max_steps: int, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=str(out_dir), save_strategy="steps", save_steps=2, save_total_limit=1, max_steps=max_steps,
        per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1000,
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def trainer(out_dir: Path, max_steps: int, callbacks: list[Any], **kw: Any) -> Trainer:
    return Trainer(model=tiny_model(), args=training_args(out_dir, max_steps, **kw), train_dataset=Tokens(),
                   callbacks=callbacks)


def count_worker_starts() -> list[int]:
    """The fold workers this process starts from now on (one entry per start)."""
    from ema_ckpt.integrations import _background

    starts: list[int] = []
    original = _background.BackgroundFolds._start

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        starts.append(os.getpid())
        original(self, *args, **kwargs)

    _background.BackgroundFolds._start = counted  # type: ignore[method-assign]
    return starts


def write_report(folder: Path, starts: list[int], result: Any, **more: Any) -> None:
    """This rank's report (``rank<N>.json``): its fold workers and what its callback did."""
    rank = int(os.environ["RANK"])
    report = {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "worker_starts": len(starts), **more,
              "result": None if result is None else {"step": result.step, "folded": result.folded,
                                                      "errors": result.errors}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps(report))


def run_arguments() -> argparse.ArgumentParser:
    """The command line of a training script run under torchrun by the callback tests."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--ema", required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--decay", type=float, default=0.8)
    return parser


def main(argv: list[str]) -> int:
    """Under torchrun: train 8 steps (saves at 2, 4, 6, 8), each rank's report in ``--report``."""
    from ema_ckpt.integrations.transformers import EmaCkptCallback

    opts = run_arguments().parse_args(argv)

    starts = count_worker_starts()
    callback = EmaCkptCallback(out=opts.ema, decay=opts.decay)
    run = trainer(opts.out_dir, 8, [RecordSaves(opts.record), callback], ddp_backend="gloo")
    run.train()
    write_report(opts.report, starts, callback.result, is_world_process_zero=run.state.is_world_process_zero)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
