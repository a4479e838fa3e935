"""The training callbacks under sharded strategies: 2 CPU ranks under torchrun (gloo), real training.

One run per ``--kind``:

- ``hf-zero3`` / ``hf-zero2``: ``transformers.Trainer`` with DeepSpeed ZeRO-3 / ZeRO-2
  (``TrainingArguments(deepspeed=...)``; ``global_step<N>/`` inside each ``checkpoint-<N>``);
- ``hf-fsdp``: ``transformers.Trainer`` with accelerate's FSDP, ``SHARDED_STATE_DICT``
  (``pytorch_model_fsdp_0/``, a DCP folder, inside each ``checkpoint-<N>``);
- ``pl-deepspeed3`` / ``pl-fsdp``: ``lightning.pytorch.Trainer`` with the DeepSpeed stage 3 strategy /
  ``FSDPStrategy(state_dict_type="sharded")``: each ``ModelCheckpoint`` save is a folder.

Every run keeps one checkpoint (``save_total_limit=1`` / ``save_top_k=1``) and saves at steps 2, 4 and 6,
with :class:`~ema_ckpt.integrations.transformers.EmaCkptCallback` (or Lightning's) folding into ``--ema``.
Retention removes the first save before its fold; at step 5 rank 0 waits for the EMA to reach step 4, so
the last save is written while the fold worker is up and looking at the folder.
Right after each save, rank 0 copies the checkpoint aside (before ema-ckpt's callback sees it); after
training it consolidates each copy with the trainer's own tool (DeepSpeed's ``zero_to_fp32``,
accelerate's ``merge_fsdp_weights``, Lightning's converters) into ``--record/step-<N>.safetensors``:
the fp32 states as saved, for the test's float64 EMA. Each rank writes ``--report/rank<R>.json``.

What CPU needs, and nothing in any saving code:

- DeepSpeed: ``DS_ACCELERATOR=cpu``; ``deepspeed.comm.torch.build_shm_op`` is a no-op (it JIT-compiles a
  shared-memory all-reduce with g++; gloo does the work); its optimizer is ``torch.optim.AdamW``
  (``torch_adam``), not the JIT-built CPU Adam.
- HF + DeepSpeed: accelerate finds no backend under torchrun without an accelerator (``use_cpu=True``
  would switch DeepSpeed off), and every rank then believes it is rank 0 of 1: gloo is given to it.
- HF + FSDP: accelerate turns FSDP on only for accelerator devices (on CPU the state stays MULTI_CPU and
  the plugin is dropped): its own FSDP branch is re-applied after ``AcceleratorState.__init__``.
- Lightning: DeepSpeedStrategy refuses any accelerator but CUDA, and passes ``root_device.index`` (None on
  CPU) as DeepSpeed's device rank; the accelerator connector refuses ``type(strategy) is FSDPStrategy``
  without CUDA, and FSDP1 on CPU needs ``device_id=cpu`` (the module wraps itself in ``configure_model``).

    torchrun --nproc-per-node 2 tests/callback_train_strategies.py --kind hf-zero3 \\
        --out-dir RUN --ema EMA --record SAVED --report R
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

KINDS = ("hf-zero3", "hf-zero2", "hf-fsdp", "pl-deepspeed3", "pl-fsdp")
MAX_STEPS = 6
SAVE_EVERY = 2
SAVED_STEPS = list(range(SAVE_EVERY, MAX_STEPS + 1, SAVE_EVERY))
PAUSE_AT = MAX_STEPS - 1
"""At this step rank 0 waits until the EMA holds the saves before it: the first saves are gone to retention
before their fold (training outruns the fold worker's start), the last one is written while the worker
is up and looking at the folder."""


# ---- CPU workarounds ---------------------------------------------------------------------------------------


def no_deepspeed_shm_build() -> None:
    """DeepSpeed's CPU communicator JIT-builds a shared-memory all-reduce (g++, minutes): gloo instead."""
    import deepspeed  # noqa: F401  (deepspeed.comm.torch needs the package imported)

    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def accelerate_gloo_for_deepspeed() -> None:
    """accelerate's backend for DeepSpeed without an accelerator: gloo (else None, one rank of one each)."""
    from accelerate.state import PartialState

    original = PartialState._prepare_backend

    def prepare_backend(self: Any, cpu: bool = False, sagemaker_dp: bool = False, backend: Any = None) -> Any:
        backend, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if backend is None and not cpu and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
            backend = "gloo"
        return backend, distributed_type

    PartialState._prepare_backend = prepare_backend


def accelerate_fsdp_on_cpu() -> None:
    """Re-apply accelerate's own FSDP branch on CPU (it keeps FSDP for accelerator devices only)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            # accelerate passes device_id=self.device (cpu:0 on MULTI_CPU); FSDP1 wants "cpu"
            self.device = torch.device("cpu")
            PartialState._shared_state["device"] = self.device

    AcceleratorState.__init__ = init


def ds_config(stage: int) -> dict[str, Any]:
    """A DeepSpeed config for the Trainer ("auto": filled from TrainingArguments)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:  # every parameter partitioned, none gathered into model.safetensors at the save
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=False)
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                                  "eps": "auto", "torch_adam": True}},
        "steps_per_print": 1000, "wall_clock_breakdown": False,
    }


def wait_for_ema(out: str, step: int, timeout: float = 120.0) -> None:
    """Block until the EMA at ``out`` holds ``step`` (the other ranks wait in their next collective)."""
    import time

    from ema_ckpt.watching import ema_step

    deadline = time.monotonic() + timeout
    while (ema_step(out) or 0) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the EMA at {out} did not reach step {step} in {timeout:.0f} s")
        time.sleep(0.1)


# ---- recording the states as saved ---------------------------------------------------------------------------


def copy_aside(source: Path, into: Path, step: int) -> None:
    """Copy the checkpoint just saved (a file or a folder) to ``into/<step>``."""
    target = into / str(step)
    if source.is_dir():
        shutil.copytree(source, target)
    else:
        into.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def consolidate_copies(kind: str, into: Path) -> None:
    """Each copy in ``into`` consolidated by the trainer's own tool, as ``step-<N>.safetensors``."""
    from safetensors.torch import save_file

    for copy in sorted(p for p in into.iterdir() if p.name.isdigit()):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state = own_consolidation(kind, copy)
        save_file({k: v.detach().float().contiguous().clone() for k, v in state.items()},
                  str(into / f"step-{copy.name}.safetensors"))
        shutil.rmtree(copy)


def own_consolidation(kind: str, copy: Path) -> dict[str, torch.Tensor]:
    if kind in ("hf-zero3", "hf-zero2"):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(copy)))
    if kind == "hf-fsdp":
        from accelerate.utils.fsdp_utils import _distributed_checkpoint_to_merged_weights
        from safetensors.torch import load_file

        # merge_fsdp_weights's work, without its barrier (rank 1 has left the process group's collectives)
        merged = _distributed_checkpoint_to_merged_weights(str(copy / "pytorch_model_fsdp_0"), str(copy / "merged"))
        return load_file(str(merged))
    if kind == "pl-deepspeed3":
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        state = convert_zero_checkpoint_to_fp32_state_dict(copy, copy.parent / f"{copy.name}.pt")
        return dict(state["state_dict"])
    from lightning.fabric.utilities.load import _load_distributed_checkpoint
    from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

    return dict(_format_checkpoint(_load_distributed_checkpoint(copy))["state_dict"])


# ---- transformers.Trainer ------------------------------------------------------------------------------------


def hf_run(kind: str, opts: argparse.Namespace) -> Any:
    from transformers import Trainer, TrainerCallback

    from ema_ckpt.integrations.transformers import EmaCkptCallback
    from tests.callback_train_hf import Tokens, tiny_model, training_args

    class CopySaves(TrainerCallback):  # type: ignore[misc]
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                copy_aside(Path(args.output_dir) / f"checkpoint-{state.global_step}", opts.record, state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero and state.global_step == PAUSE_AT:
                wait_for_ema(opts.ema, PAUSE_AT - 1)

    if kind == "hf-fsdp":
        accelerate_fsdp_on_cpu()
        strategy: dict[str, Any] = dict(use_cpu=True, fsdp="full_shard", fsdp_config={
            "state_dict_type": "SHARDED_STATE_DICT", "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    else:
        no_deepspeed_shm_build()
        accelerate_gloo_for_deepspeed()
        strategy = dict(use_cpu=False, deepspeed=ds_config(3 if kind == "hf-zero3" else 2))
    callback = EmaCkptCallback(out=opts.ema, decay=opts.decay)
    args = training_args(opts.out_dir, MAX_STEPS, save_steps=SAVE_EVERY, per_device_train_batch_size=2,
                         ddp_backend="gloo", **strategy)
    trainer = Trainer(model=tiny_model(), args=args, train_dataset=Tokens(), callbacks=[CopySaves(), callback])
    assert trainer.is_fsdp_enabled if kind == "hf-fsdp" else trainer.is_deepspeed_enabled
    trainer.train()
    return callback.result, trainer.state.is_world_process_zero


# ---- Lightning -------------------------------------------------------------------------------------------------


def pl_run(kind: str, opts: argparse.Namespace) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
    from torch import nn

    from ema_ckpt.integrations.lightning import EmaCkptCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.GELU(), nn.Linear(10, 3))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.model(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=2e-2, weight_decay=0.01)

    class TinyFSDP(Tiny):
        def configure_model(self) -> None:  # FSDP1 on CPU needs device_id=cpu, which Lightning does not give
            from torch.distributed.fsdp import FullyShardedDataParallel

            if not isinstance(self.model, FullyShardedDataParallel):
                self.model = FullyShardedDataParallel(self.model, device_id=torch.device("cpu"), use_orig_params=True)

    class CPUFSDPStrategy(FSDPStrategy):  # type: ignore[misc]
        """The connector refuses ``type(strategy) is FSDPStrategy`` without CUDA; a subclass passes."""

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):  # type: ignore[misc]
        """DeepSpeedStrategy without its CUDA-only checks; saving untouched."""

        def setup_environment(self) -> None:
            super(DeepSpeedStrategy, self).setup_environment()  # skips "only supported on CUDA GPUs"

        def setup_distributed(self) -> None:
            from lightning.pytorch.strategies.deepspeed import reset_seed

            reset_seed()  # no _validate_device_index_selection: CPU devices have no index
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            import deepspeed

            engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, deepspeed_optimizer

    class Pause(pl.Callback):  # after ema-ckpt's callback, which stages step 4's save in this same hook
        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if trainer.is_global_zero and trainer.global_step == PAUSE_AT:
                wait_for_ema(opts.ema, PAUSE_AT - 1)

    class CopyingCheckpoint(ModelCheckpoint):  # type: ignore[misc]
        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            super()._save_checkpoint(trainer, filepath)  # trainer.save_checkpoint ends with a barrier
            if trainer.is_global_zero:
                copy_aside(Path(filepath), opts.record, trainer.global_step)

    pl.seed_everything(0)
    if kind == "pl-fsdp":
        module: Any = TinyFSDP()
        strategy: Any = CPUFSDPStrategy(state_dict_type="sharded", process_group_backend="gloo")
    else:
        no_deepspeed_shm_build()
        module = Tiny()
        strategy = CPUDeepSpeedStrategy(process_group_backend="gloo", config={
            "zero_allow_untested_optimizer": True, "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g))
    ema = EmaCkptCallback(opts.ema, decay=opts.decay)
    checkpoint = CopyingCheckpoint(dirpath=opts.out_dir, every_n_train_steps=SAVE_EVERY, save_top_k=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=MAX_STEPS,
                         callbacks=[ema, Pause(), checkpoint], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(opts.out_dir))
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return ema.result, trainer.is_global_zero


def main(argv: list[str]) -> int:
    """Train (2 ranks), then rank 0 consolidates its copies; each rank reports what its callback did."""
    from tests.callback_train_hf import count_worker_starts, run_arguments, write_report

    parser = run_arguments()
    parser.add_argument("--kind", choices=KINDS, required=True)
    opts = parser.parse_args(argv)

    starts = count_worker_starts()
    result, zero = (hf_run if opts.kind.startswith("hf-") else pl_run)(opts.kind, opts)
    rank = int(os.environ["RANK"])
    if rank == 0:
        consolidate_copies(opts.kind, opts.record)
    write_report(opts.report, starts, result, global_zero=zero)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
