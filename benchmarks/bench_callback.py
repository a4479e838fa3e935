"""What ``EmaCkptCallback`` costs a ``transformers.Trainer`` run: the training-step time with it
against the same run without it (CPU, a small Llama, 40 steps, a save every 5, ``save_total_limit=1``).

The step time is taken from ``on_step_begin`` to ``on_step_end`` (forward, backward, optimizer:
saves excluded), so it shows what the fold worker's competition for the CPU costs training. The
run's wall time is given too (saves included), and the time ``on_train_end`` waits for the last
folds. On a machine with few cores the fold worker (a second process) competes with training for
them: there the ratio is the price of that competition, not of the callback's own work (a few
hard links per save).

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_callback.py [--steps 40] [--save-every 5] [--hidden 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from ema_ckpt.integrations.transformers import EmaCkptCallback

VOCAB, SEQ = 512, 64


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[float] = []
        self.end_wait = 0.0
        self._t = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._t = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(time.perf_counter() - self._t)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._t = time.perf_counter()  # the callbacks after this one (ours) run next


def run(folder: Path, steps: int, save_every: int, hidden: int, ema: bool) -> tuple[list[float], float, float, int]:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    model = LlamaForCausalLM(config)
    times = StepTimes()
    callbacks: list[Any] = [times]
    if ema:
        callbacks.append(EmaCkptCallback(out=folder / "ema", decay=0.99))
    args = TrainingArguments(output_dir=str(folder), save_strategy="steps", save_steps=save_every, save_total_limit=1,
                             max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3, report_to=[],
                             use_cpu=True, disable_tqdm=True, logging_steps=10_000, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(8 * steps), callbacks=callbacks)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    end_wait = time.perf_counter() - times._t
    params = sum(p.numel() for p in model.parameters())
    return times.steps, wall, end_wait, params


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    opts = parser.parse_args(argv)
    print(f"cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(tmp) / "warmup", 3, 1000, opts.hidden, ema=False)  # imports and first-call costs
        rows = {}
        for name, ema in (("without", False), ("with", True)):
            rows[name] = run(Path(tmp) / name, opts.steps, opts.save_every, opts.hidden, ema)
    params = rows["with"][3]
    print(f"model: {params / 1e6:.1f} M parameters, {opts.steps} steps, a save every {opts.save_every}")
    for name, (steps, wall, end_wait, _) in rows.items():
        print(f"{name:>8} callback: step mean {statistics.mean(steps) * 1e3:7.1f} ms, median "
              f"{statistics.median(steps) * 1e3:7.1f} ms; run wall {wall:6.2f} s (end-of-training wait "
              f"{end_wait:5.2f} s)")
    with_steps, without_steps = rows["with"][0], rows["without"][0]
    print(f"ratio (with / without): step mean {statistics.mean(with_steps) / statistics.mean(without_steps):.3f}, "
          f"step median {statistics.median(with_steps) / statistics.median(without_steps):.3f}, "
          f"run wall {rows['with'][1] / rows['without'][1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
