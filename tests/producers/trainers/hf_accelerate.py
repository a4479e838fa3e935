"""Produce real trainer-written checkpoint fixtures (HF Accelerate / HF Trainer / DeepSpeed) on CPU.

Every checkpoint file under ``<out>/<set>/ckpts`` is written by the framework's own saving code
(``Accelerator.save_state``, ``Trainer`` checkpointing / ``Trainer.save_model``, DeepSpeed's
``engine.save_checkpoint`` as the Trainer calls it). Nothing is laid out by hand. Beside the
checkpoints, ``<out>/<set>/oracle/`` holds each framework tool's own consolidation of every
checkpoint (accelerate's ``merge_fsdp_weights`` / DeepSpeed's
``get_fp32_state_dict_from_zero_checkpoint``) and ``<out>/<set>/producer.json`` records versions,
the command, and the true optimizer step of each checkpoint as the training loop knew it.

Usage (from the repository root)::

    .venv-fixtures/bin/python tests/producers/trainers/hf_accelerate.py \
        --out tests/fixtures/trainers --set all

``--set`` takes ``all`` or a comma-separated list of: accelerate-fsdp2, accelerate-fsdp1,
hf-trainer-fsdp, hf-trainer-zero2-bf16, hf-trainer-zero3-final. Each set directory is deleted and
rewritten. The script launches itself under torchrun (2 CPU ranks, gloo, OMP_NUM_THREADS=1) for
training (``_worker`` subcommand) and then in a plain single process for the oracles
(``_oracle`` subcommand).

CPU-only patches (none touches any saving code):

* accelerate enables FSDP only for accelerator device types: after ``AcceleratorState.__init__``
  we set ``distributed_type = DistributedType.FSDP`` and ``fsdp_plugin`` exactly as its own FSDP
  branch would have (``_patch_accelerate_fsdp_on_cpu``). FSDP1 gets ``device_id=cpu`` from
  accelerate itself (``self.device``).
* DeepSpeed's CPU communicator JIT-builds a shared-memory all-reduce op with g++/ninja; we replace
  ``deepspeed.comm.torch.build_shm_op`` with a no-op so plain gloo is used (as
  ``tests/producers/deepspeed_train.py`` does).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_common import TORCHRUN_VARS as _TORCHRUN_VARS
from fixture_common import drop_deepspeed_scripts, free_port

SETS = (
    "accelerate-fsdp2",
    "accelerate-fsdp1",
    "hf-trainer-fsdp",
    "hf-trainer-zero2-bf16",
    "hf-trainer-zero3-final",
)
WORLD_SIZE = 2
SEED = 1234
SEQ_LEN = 16
VOCAB = 64
# One decoder layer: DCP stores every tensor shard as its own torch.save record (~1.5 KB overhead
# each), so the layer count, not the width, sets the fixture size (2 layers: ~1.4 MB per FSDP set).
NUM_LAYERS = 1

# accelerate sets: save after these optimizer steps; gradient accumulation of 2 micro-batches and
# 7 micro-batches per rank per epoch, so the last accumulation of each epoch is short (1 batch) and
# accelerate's own "step" counter (micro-batches since the dataloader epoch began) differs from the
# optimizer step and resets between saves.
ACC_SAVE_AFTER = (2, 3, 6)
ACC_GRAD_ACCUM = 2
ACC_BATCHES_PER_EPOCH = 7
ACC_BATCH = 2  # per rank



# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------




def versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "transformers", "accelerate", "deepspeed", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def tiny_llama(tie: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def random_tokens(n: int):
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, VOCAB, (n, SEQ_LEN), generator=g)


class TokenDataset:
    """Random token sequences as {"input_ids", "labels"} dicts (labels = inputs; the model shifts)."""

    def __init__(self, n: int) -> None:
        self.data = random_tokens(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


def _patch_accelerate_fsdp_on_cpu() -> None:
    """accelerate turns FSDP on only for accelerator devices (MULTI_GPU, MULTI_XPU, ...); on CPU the
    state stays MULTI_CPU and the plugin is dropped. Re-apply its own FSDP branch after __init__."""
    import torch
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_cpu_fsdp_patch", False):
        return
    orig = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        orig(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            if fsdp_plugin.fsdp_version == 1 and self.device.type == "cpu":
                # accelerate passes device_id=self.device (cpu:0 on MULTI_CPU); FSDP1 compares it with
                # torch.cpu.current_device() == "cpu" and refuses the mismatch.
                self.device = torch.device("cpu")
                PartialState._shared_state["device"] = self.device

    init._cpu_fsdp_patch = True
    AcceleratorState.__init__ = init


def _patch_deepspeed_no_shm_build() -> None:
    importlib.import_module("deepspeed.comm.torch")
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def _patch_accelerate_deepspeed_backend_on_cpu() -> None:
    """Under torchrun with DeepSpeed and no accelerator, accelerate's PartialState._prepare_backend
    finds no backend (it knows gloo only with cpu=True, which switches DeepSpeed off), so it calls
    deepspeed.init_distributed(dist_backend=None) but then sets num_processes=1 / process_index=0 on
    every rank (every rank a 'main process', world size 1 in the DeepSpeed batch check). Give it the
    gloo backend it would pick for CPU; everything else is accelerate's own DeepSpeed path."""
    from accelerate.state import PartialState

    if getattr(PartialState._prepare_backend, "_cpu_ds_patch", False):
        return
    orig = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        backend, distributed_type = orig(self, cpu, sagemaker_dp, backend)
        if (
            backend is None
            and not cpu
            and int(os.environ.get("LOCAL_RANK", -1)) != -1
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        ):
            backend = "gloo"
        return backend, distributed_type

    prepare_backend._cpu_ds_patch = True
    PartialState._prepare_backend = prepare_backend


def _patch_transformers_bf16_check() -> None:
    """TrainingArguments refuses bf16=True unless a GPU-like device reports bf16 support or
    use_cpu=True; use_cpu=True would switch DeepSpeed off. DeepSpeed's CPU accelerator does bf16,
    so only this validation check is bypassed (it is the module's only use of the function)."""
    import transformers.training_args as ta

    ta.is_torch_bf16_gpu_available = lambda: True


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# --------------------------------------------------------------------------------------------
# workers (run under torchrun, 2 ranks)
# --------------------------------------------------------------------------------------------


def work_accelerate(set_dir: Path, fsdp_version: int) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration, set_seed

    _patch_accelerate_fsdp_on_cpu()
    set_seed(SEED)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=fsdp_version,
        state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        **({"reshard_after_forward": True} if fsdp_version == 2 else {"sharding_strategy": "FULL_SHARD"}),
    )
    accelerator = Accelerator(
        cpu=True,  # MULTI_CPU + gloo under torchrun (the FSDP patch then turns it into FSDP)
        fsdp_plugin=plugin,
        gradient_accumulation_steps=ACC_GRAD_ACCUM,
        project_config=ProjectConfiguration(
            project_dir=str(set_dir / "ckpts"), automatic_checkpoint_naming=True
        ),
    )
    assert accelerator.distributed_type.value == "FSDP", accelerator.distributed_type
    model = tiny_llama()
    data = TokenDataset(ACC_BATCHES_PER_EPOCH * ACC_BATCH * WORLD_SIZE)
    dl = torch.utils.data.DataLoader(data, batch_size=ACC_BATCH, shuffle=False)
    if fsdp_version == 2:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=0.5, total_iters=20
        )
        model, optimizer, dl, scheduler = accelerator.prepare(model, optimizer, dl, scheduler)
    else:
        model = accelerator.prepare(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0, end_factor=0.5, total_iters=20
        )
        optimizer, dl, scheduler = accelerator.prepare(optimizer, dl, scheduler)

    records: dict[str, dict] = {}
    opt_step = micro = 0
    last = max(ACC_SAVE_AFTER)
    epoch = 0
    while opt_step < last:
        for batch in dl:
            micro += 1
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                opt_step += 1
                if opt_step in ACC_SAVE_AFTER:
                    loc = accelerator.save_state()
                    rel = os.path.relpath(loc, set_dir)
                    records[rel] = {
                        "optimizer_step": opt_step,
                        "epoch": epoch,
                        "micro_batches_seen": micro,
                        "accelerator.step_at_save": accelerator.step,
                        "save_iteration": accelerator.save_iteration - 1,
                        "scheduler_last_epoch": scheduler.scheduler.last_epoch,
                        "loss": float(loss.detach()),
                    }
                if opt_step >= last:
                    break
        epoch += 1
    accelerator.wait_for_everyone()
    notes = [
        f"FSDP{fsdp_version} via accelerate on {WORLD_SIZE} CPU ranks (gloo); SHARDED_STATE_DICT; "
        "transformer_based_wrap on LlamaDecoderLayer.",
        f"gradient_accumulation_steps={ACC_GRAD_ACCUM}, {ACC_BATCHES_PER_EPOCH} micro-batches of "
        f"{ACC_BATCH} per rank per epoch, no shuffling; accelerate forces a sync at the end of each "
        "dataloader epoch, so the 4th optimizer step of each epoch accumulates one micro-batch only.",
        "random_states_<rank>.pkl['step'] is Accelerator.step: micro-batches since the current dataloader "
        "epoch began (reset to 0 on the epoch's last batch), NOT the optimizer step.",
        "LinearLR scheduler prepared by accelerate: AcceleratedScheduler steps the wrapped scheduler "
        "num_processes times per optimizer step (split_batches=False), so scheduler.bin last_epoch = 2 * "
        "optimizer_step.",
        "AdamW(lr=1e-2, weight_decay=0.01); optimizer_0 state 'step' per parameter = optimizer steps taken.",
        "CPU patch: AcceleratorState.distributed_type forced to DistributedType.FSDP and fsdp_plugin "
        "attached after AcceleratorState.__init__ (accelerate enables FSDP only for accelerator device "
        "types)"
        + (
            "; and state.device set from cpu:0 to cpu, because FSDP1 refuses device_id cpu:0 when "
            "torch.cpu.current_device() is 'cpu'."
            if fsdp_version == 1
            else "."
        ),
    ]
    return {"checkpoints": records, "notes": notes}


def _trainer_common_args(**kw):
    from transformers import TrainingArguments

    base = dict(
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="steps",
        report_to="none",
        seed=SEED,
        data_seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_backend="gloo",
        use_cpu=False,
    )
    base.update(kw)
    return TrainingArguments(**base)


def work_trainer_fsdp(set_dir: Path) -> dict:
    from transformers import Trainer

    _patch_accelerate_fsdp_on_cpu()
    args = _trainer_common_args(
        output_dir=str(set_dir / "ckpts"),
        max_steps=6,
        save_steps=2,
        gradient_accumulation_steps=1,
        use_cpu=True,  # MULTI_CPU + gloo (the FSDP patch then turns it into FSDP)
        fsdp="full_shard",
        fsdp_config={
            "state_dict_type": "SHARDED_STATE_DICT",
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        },
    )
    model = tiny_llama()
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(32))
    assert trainer.is_fsdp_enabled, "FSDP did not get enabled"
    steps = _record_trainer_saves(trainer)
    trainer.train()
    return {
        "checkpoints": _trainer_records(set_dir, steps),
        "notes": [
            "transformers Trainer, fsdp='full_shard' "
            f"(FSDP{trainer.accelerator.state.fsdp_plugin.fsdp_version}), fsdp_config "
            "state_dict_type=SHARDED_STATE_DICT, transformer_layer_cls_to_wrap=LlamaDecoderLayer, "
            f"{WORLD_SIZE} CPU ranks (gloo).",
            "max_steps=6, save_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=1, "
            "linear LR.",
            "optimizer_step = trainer.state.global_step at the save (the checkpoint-N suffix).",
            "CPU patch: AcceleratorState.distributed_type forced to DistributedType.FSDP and fsdp_plugin "
            "attached after AcceleratorState.__init__ (accelerate enables FSDP only for accelerator device "
            "types).",
        ],
    }


def _ds_config(stage: int, bf16: bool, gather: bool | None = None) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(
            {
                "stage3_gather_16bit_weights_on_model_save": bool(gather),
                "sub_group_size": 1000,
                "stage3_param_persistence_threshold": 0,
                "stage3_max_live_parameters": 1000,
            }
        )
    cfg = {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        # torch_adam: DeepSpeed uses torch.optim.AdamW instead of JIT-compiling its FusedAdam op for CPU
        # (a g++ build of minutes); the checkpoint layout is the same.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": "auto",
                "weight_decay": "auto",
                "betas": "auto",
                "eps": "auto",
                "torch_adam": True,
            },
        },
        # No "scheduler" section: the Trainer's own linear schedule is handed to DeepSpeed. (DeepSpeed's
        # WarmupDecayLR with warmup_num_steps "auto" = 0 runs the first two steps at lr 0, which would
        # make checkpoint-2 equal to the initial weights.)
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": "auto"}
    return cfg


def work_trainer_deepspeed(set_dir: Path, which: str) -> dict:
    from transformers import Trainer

    _patch_deepspeed_no_shm_build()
    _patch_accelerate_deepspeed_backend_on_cpu()
    if which == "zero2-bf16":
        _patch_transformers_bf16_check()
        ds = _ds_config(2, bf16=True)
        args = _trainer_common_args(
            output_dir=str(set_dir / "ckpts"),
            max_steps=6,
            save_steps=2,
            gradient_accumulation_steps=2,
            bf16=True,
            deepspeed=ds,
        )
        model = tiny_llama(tie=False)
    else:
        ds = _ds_config(3, bf16=False, gather=False)
        args = _trainer_common_args(
            output_dir=str(set_dir / "ckpts"),
            max_steps=5,
            save_steps=2,
            gradient_accumulation_steps=1,
            deepspeed=ds,
        )
        model = tiny_llama(tie=True)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(48))
    steps = _record_trainer_saves(trainer)
    trainer.train()
    records = _trainer_records(set_dir, steps)
    notes = [
        f"transformers Trainer + DeepSpeed ZeRO-{ds['zero_optimization']['stage']} on {WORLD_SIZE} CPU "
        "ranks (DS_ACCELERATOR=cpu, gloo).",
        "DeepSpeed config (Trainer fills the 'auto' values): " + json.dumps(ds, sort_keys=True),
        "optimizer_step = trainer.state.global_step at the save (the checkpoint-N / global_stepN suffix).",
        "CPU patch: deepspeed.comm.torch.build_shm_op replaced by a no-op (skips the g++/ninja JIT build "
        "of DeepSpeed's CPU shared-memory all-reduce; gloo does the communication).",
        "CPU patch: accelerate's PartialState._prepare_backend returns backend None under torchrun without "
        "an accelerator (cpu=True would disable DeepSpeed), which leaves num_processes=1 / process_index=0 "
        "on every rank; the patch substitutes 'gloo' so accelerate sees the real world size and ranks.",
        "DeepSpeed optimizer AdamW with torch_adam=true (torch.optim.AdamW; avoids JIT-compiling FusedAdam "
        "for CPU). No DeepSpeed scheduler section: the Trainer's linear schedule is used.",
    ]
    if which == "zero2-bf16":
        notes.append(
            "CPU patch: transformers.training_args.is_torch_bf16_gpu_available -> True, because "
            "TrainingArguments refuses bf16=True without a bf16 GPU unless use_cpu=True (which would "
            "disable DeepSpeed)."
        )
        notes.append(
            "bf16=True, gradient_accumulation_steps=2, max_steps=6, save_steps=2. Each checkpoint-N also "
            "holds the Trainer's model.safetensors (bf16, gathered by Trainer.save_model under ZeRO-2)."
        )
    else:
        notes.append(
            "fp32, tie_word_embeddings=True, max_steps=5, save_steps=2 (checkpoint-5 is the Trainer's "
            "end-of-training save). stage3_gather_16bit_weights_on_model_save=false, then "
            "trainer.save_model() (as run_clm.py does) hits its ValueError fallback and calls "
            "engine.save_checkpoint(output_dir): ckpts/global_step5/ and ckpts/latest beside "
            "ckpts/checkpoint-N/ (plus config.json etc. from Trainer._save with an empty state dict; the "
            "Trainer removes its dummy weights file itself)."
        )
        trainer.save_model()
        records["ckpts"] = {
            "optimizer_step": trainer.state.global_step,
            "tag": f"global_step{trainer.state.global_step}",
            "written_by": "trainer.save_model() -> engine.save_checkpoint(output_dir)",
        }
    return {"checkpoints": records, "notes": notes}


def _record_trainer_saves(trainer) -> list[int]:
    from transformers import TrainerCallback

    saved: list[int] = []

    class _Rec(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            saved.append(state.global_step)

    trainer.add_callback(_Rec())
    return saved


def _trainer_records(set_dir: Path, steps: list[int]) -> dict:
    return {
        f"ckpts/checkpoint-{s}": {
            "optimizer_step": s,
            "source": "trainer.state.global_step (on_save callback)",
        }
        for s in steps
    }


def worker(set_name: str, set_dir: Path) -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    if set_name == "accelerate-fsdp2":
        result = work_accelerate(set_dir, 2)
    elif set_name == "accelerate-fsdp1":
        result = work_accelerate(set_dir, 1)
    elif set_name == "hf-trainer-fsdp":
        result = work_trainer_fsdp(set_dir)
    elif set_name == "hf-trainer-zero2-bf16":
        result = work_trainer_deepspeed(set_dir, "zero2-bf16")
    elif set_name == "hf-trainer-zero3-final":
        result = work_trainer_deepspeed(set_dir, "zero3-final")
    else:
        raise SystemExit(f"unknown set {set_name}")
    if _rank() == 0:
        _write_json(set_dir / "_worker.json", result)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# oracles (plain single process)
# --------------------------------------------------------------------------------------------


def _save_state_dict(sd: dict, path: Path) -> dict:
    """Clone to contiguous tensors and save; tensors sharing storage are stored once and the
    aliases returned as {alias: stored_name}."""
    from safetensors.torch import save_file

    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    out = {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()), v.dtype)
        if v.numel() and key in seen:
            aliases[k] = seen[key]
            continue
        seen[key] = k
        out[k] = v.detach().clone().contiguous()
    save_file(out, str(path), metadata={"format": "pt"})
    return aliases


def oracle(set_name: str, set_dir: Path, checkpoints: dict) -> dict:
    import torch

    odir = set_dir / "oracle"
    odir.mkdir(exist_ok=True)
    result = {}
    for rel, info in checkpoints.items():
        ck = set_dir / rel
        name = ck.name
        target = odir / f"{name}.safetensors"
        if set_name.startswith("accelerate") or set_name == "hf-trainer-fsdp":
            from accelerate.utils import merge_fsdp_weights

            with tempfile.TemporaryDirectory() as tmp:
                merge_fsdp_weights(str(ck / "pytorch_model_fsdp_0"), tmp, safe_serialization=True)
                shutil.move(os.path.join(tmp, "model.safetensors"), target)
            result[rel] = {
                "oracle": str(target.relative_to(set_dir)),
                "oracle_tool": "accelerate.utils.merge_fsdp_weights",
            }
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            tag = info.get("tag")
            sd = get_fp32_state_dict_from_zero_checkpoint(str(ck), tag=tag)
            # DeepSpeed may hand back lazy tensors; make them real torch tensors first
            sd = {
                k: (v.contiguous() if isinstance(v, torch.Tensor) else torch.as_tensor(v))
                for k, v in sd.items()
            }
            aliases = _save_state_dict(sd, target)
            entry = {
                "oracle": str(target.relative_to(set_dir)),
                "oracle_tool": "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
                "oracle_keys": list(sd.keys()),
            }
            if aliases:
                entry["oracle_aliases"] = aliases
            result[rel] = entry
    return result


# --------------------------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------------------------


def _run(cmd: list[str], env: dict, timeout: float, log: Path, cwd: Path | None = None) -> None:
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    if rc != 0:
        text = log.read_text()
        first = text.find("Traceback")
        excerpt = text[first : first + 6000] if first >= 0 else text[-6000:]
        raise RuntimeError(f"command failed (rc={rc}): {' '.join(cmd)}\nlog: {log}\n{excerpt}")




def produce(set_name: str, out: Path, timeout: float, keep_logs: bool) -> None:
    set_dir = (out / set_name).resolve()
    if set_dir.exists():
        shutil.rmtree(set_dir)
    set_dir.mkdir(parents=True)
    script = str(Path(__file__).resolve())
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore"),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "ACCELERATE_DISABLE_RICH": "1",
        }
    )
    logs = Path(tempfile.mkdtemp(prefix=f"producer-{set_name}-"))
    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(WORLD_SIZE), "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            script, "_worker", "--set", set_name, "--dir", ".",
        ]  # fmt: skip
        try:
            # Run inside the set folder with relative paths, so the paths the frameworks record
            # (DCP .metadata storage_meta.checkpoint_id, training_args.bin output_dir) are relative.
            _run(cmd, env, timeout, logs / "worker.log", cwd=set_dir)
            break
        except RuntimeError as e:
            # A port taken between picking and binding it, or gloo's rare abort at process teardown
            # on a loaded 2-core machine ("terminate called without an active exception"): run again.
            text = (logs / "worker.log").read_text(errors="replace").lower()
            retry = "address already in use" in str(e).lower() or "terminate called without an active" in text
            if attempt == 0 and retry:
                shutil.rmtree(set_dir)
                set_dir.mkdir(parents=True)
                continue
            raise
    worker_json = set_dir / "_worker.json"
    result = json.loads(worker_json.read_text())
    worker_json.unlink()
    (set_dir / "_ckpts.json").write_text(json.dumps(result["checkpoints"]))
    ocmd = [sys.executable, script, "_oracle", "--set", set_name, "--dir", str(set_dir)]
    _run(ocmd, env, timeout, logs / "oracle.log")
    oracles = json.loads((set_dir / "_oracle.json").read_text())
    (set_dir / "_oracle.json").unlink()
    (set_dir / "_ckpts.json").unlink()
    checkpoints = {rel: {**info, **oracles.get(rel, {})} for rel, info in result["checkpoints"].items()}
    for rel in checkpoints:
        if not (set_dir / rel).is_dir():
            raise RuntimeError(f"{set_name}: checkpoint folder {rel} missing")
    producer = {
        "set": set_name,
        "versions": versions(),
        "python": sys.version.split()[0],
        "world_size": WORLD_SIZE,
        "seed": SEED,
        "command": ".venv-fixtures/bin/python tests/producers/trainers/hf_accelerate.py "
        f"--out tests/fixtures/trainers --set {set_name}  (launches: python -m torch.distributed.run "
        f"--nproc-per-node {WORLD_SIZE} tests/producers/trainers/hf_accelerate.py _worker --set {set_name} "
        "--dir . (cwd = the set folder); then: python tests/producers/trainers/hf_accelerate.py _oracle "
        f"--set {set_name} --dir <set>)",
        "env": {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
        "model": "LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, "
        f"num_hidden_layers={NUM_LAYERS}, num_attention_heads=2, num_key_value_heads=1, vocab_size=64, "
        "max_position_embeddings=32"
        + (
            ", tie_word_embeddings=True"
            if set_name == "hf-trainer-zero3-final"
            else ", tie_word_embeddings=False"
        )
        + f")), torch.manual_seed({SEED}); random token data (seq len {SEQ_LEN}), labels = input_ids",
        "checkpoints": checkpoints,
        "notes": result["notes"] + drop_deepspeed_scripts(set_dir),
    }
    _write_json(set_dir / "producer.json", producer)
    if keep_logs:
        print(f"{set_name}: logs in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    print(f"{set_name}: {len(checkpoints)} checkpoints -> {set_dir}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_worker", "_oracle"):
        sub = sys.argv[1]
        p = argparse.ArgumentParser()
        p.add_argument("--set", required=True)
        p.add_argument("--dir", required=True, type=Path)
        a = p.parse_args(sys.argv[2:])
        if sub == "_worker":
            worker(a.set, a.dir)
        else:
            cks = json.loads((a.dir / "_ckpts.json").read_text())
            _write_json(a.dir / "_oracle.json", oracle(a.set, a.dir, cks))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--set", default="all", help="all, or comma-separated: " + ", ".join(SETS))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--keep-logs", action="store_true")
    a = p.parse_args()
    names = list(SETS) if a.set == "all" else [s.strip() for s in a.set.split(",") if s.strip()]
    bad = [n for n in names if n not in SETS]
    if bad:
        p.error(f"unknown set(s) {bad}; choose from {SETS}")
    failed = []
    for n in names:
        try:
            produce(n, a.out, a.timeout, a.keep_logs)
        except Exception as e:  # report every set, then fail
            failed.append(n)
            print(f"{n}: FAILED\n{e}", file=sys.stderr)
    if failed:
        raise SystemExit(f"failed sets: {failed}")


if __name__ == "__main__":
    main()
