"""Produce real checkpoint folders whose weights are ``.bin`` / ``.safetensors`` state dicts.

Every checkpoint file under ``<out>/<set>/ckpts`` is written by the framework's own saving code
(``Accelerator.save_state``, the transformers ``Trainer``'s checkpointing, ``save_pretrained``,
peft's adapter saving as the Trainer calls it). Nothing is laid out by hand. Beside the
checkpoints, ``<out>/<set>/oracle/<checkpoint>.safetensors`` holds the model weights of each
checkpoint as the framework's own loading code gets them, and ``<out>/<set>/producer.json``
records versions, the command, the optimizer step of each checkpoint as the training loop knew it,
and the step counters the saved files themselves record.

Sets:

* ``accelerate-fsdp2-full`` / ``accelerate-fsdp1-full``: accelerate FSDP2 / FSDP1 with
  ``state_dict_type="FULL_STATE_DICT"`` on 2 CPU ranks, ``Accelerator.save_state()`` with
  ``automatic_checkpoint_naming`` -> ``checkpoint_<i>/pytorch_model_fsdp.bin`` + ``optimizer.bin``.
* ``accelerate-plain`` / ``accelerate-plain-bin``: accelerate DDP on 2 CPU ranks (no FSDP),
  ``save_state()`` (``model.safetensors``) / ``save_state(safe_serialization=False)``
  (``pytorch_model.bin``).
* ``transformers4-bin``: transformers 4 ``Trainer`` with ``save_safetensors=False``, 1 process.
* ``transformers4-bin-sharded``: the same training, with ``save_strategy="no"`` and a callback that
  calls ``model.save_pretrained(checkpoint-N, safe_serialization=False, max_shard_size=...)``
  every 2 steps (transformers 4's Trainer never passes a shard size to ``save_pretrained``).
* ``peft-lora``: transformers 5 ``Trainer`` training a peft LoRA adapter, 1 process.

Usage (from the repository root)::

    .venv/bin/python tests/producers/trainers/bin_folders.py \
        --out tests/fixtures/trainers --set all

``--set`` takes ``all`` or a comma-separated list of set names. Each set directory is deleted and
rewritten. The running interpreter needs torch 2.13, transformers 5, accelerate and peft; the
``transformers4-*`` sets run under ``--tf4-python`` (default ``.venv-fixtures-tf4/bin/python``, a
virtualenv with ``tests/producers/trainers/requirements-tf4.txt``). 2-rank sets launch this script
under torchrun (gloo, OMP_NUM_THREADS=1, ``_worker`` subcommand) and then read the written files in
a plain process (``_oracle``); 1-process sets do both in one ``_worker`` process.

CPU-only patches (none touches accelerate's or transformers' saving code):

* the accelerate FSDP sets reuse ``_patch_accelerate_fsdp_on_cpu`` from ``hf_accelerate.py``
  (accelerate enables FSDP only for accelerator device types; FSDP1 needs ``device_id=cpu``
  rather than ``cpu:0``);
* FSDP1 ``FULL_STATE_DICT``: torch's ``FlatParamHandle.to_cpu()`` (the ``offload_to_cpu=True``
  that accelerate sets with more than one process) is a no-op when the compute device is already
  the CPU (``_patch_fsdp1_offload_to_cpu_on_cpu``); unpatched, it frees the very storage it just
  "moved" and ``state_dict()`` fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))
from fixture_common import TORCHRUN_VARS, free_port, optimizer_steps  # noqa: E402
from hf_accelerate import (  # noqa: E402  (stdlib-only at import time)
    ACC_BATCH,
    ACC_BATCHES_PER_EPOCH,
    ACC_GRAD_ACCUM,
    ACC_SAVE_AFTER,
    SEED,
    TokenDataset,
    _patch_accelerate_fsdp_on_cpu,
    _run,
    _save_state_dict,
    _write_json,
)

SETS = (
    "accelerate-fsdp2-full",
    "accelerate-fsdp1-full",
    "accelerate-plain",
    "accelerate-plain-bin",
    "transformers4-bin",
    "transformers4-bin-sharded",
    "peft-lora",
)
TORCHRUN_SETS = ("accelerate-fsdp2-full", "accelerate-fsdp1-full", "accelerate-plain", "accelerate-plain-bin")
TF4_SETS = ("transformers4-bin", "transformers4-bin-sharded")
WORLD_SIZE = 2

# The tiny Llama of hf_accelerate.py (LlamaConfig keyword arguments), torch.manual_seed(SEED) first.
MODEL_CONFIG = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=64,
    max_position_embeddings=32,
    tie_word_embeddings=False,
    use_cache=False,
)
# Trainer sets (transformers 4 and peft): 1 process, 6 optimizer steps, a save every 2.
TRAINER_MAX_STEPS = 6
TRAINER_SAVE_EVERY = 2
TRAINER_BATCH = 2
TRAINER_DATA = 16
# ~17 KB of fp32 weights in 9 tensors: 5KB shards give a few files (a tensor above the limit gets a shard
# of its own).
SHARD_SIZE = "5KB"
LORA_CONFIG = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], bias="none")


def versions(extra: tuple[str, ...] = ()) -> dict[str, str | None]:
    out = {}
    for pkg in ("torch", "transformers", "accelerate", "safetensors", "numpy", *extra):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG))


def _patch_fsdp1_offload_to_cpu_on_cpu() -> None:
    """FSDP1 FULL_STATE_DICT with offload_to_cpu=True (accelerate sets it whenever num_processes > 1) runs
    FlatParamHandle.to_cpu(): it moves the unsharded flat parameter to the CPU and frees the compute-device
    copy. With the compute device itself the CPU, the move is a no-op and the free then empties the only
    storage ("setStorage: ... out of bounds for storage of size 0"). When the handle already lives on the
    CPU the context does nothing: the parameter is already where the offload would put it."""
    import contextlib

    from torch.distributed.fsdp._flat_param import FlatParamHandle

    if getattr(FlatParamHandle.to_cpu, "_cpu_patch", False):
        return
    orig = FlatParamHandle.to_cpu

    def to_cpu(self):
        if self.device.type == "cpu":
            return contextlib.nullcontext()
        return orig(self)

    to_cpu._cpu_patch = True
    FlatParamHandle.to_cpu = to_cpu


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _load(path: Path):
    """torch.load a file this script just wrote (random_states pickles hold numpy/python RNG state)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def _state_keys(opt_sd: dict) -> list:
    return [k if isinstance(k, (int, str)) else repr(k) for k in opt_sd.get("state", {})]


# --------------------------------------------------------------------------------------------
# accelerate (torchrun, 2 ranks)
# --------------------------------------------------------------------------------------------


def work_accelerate(set_name: str) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration, set_seed

    fsdp_version = {"accelerate-fsdp2-full": 2, "accelerate-fsdp1-full": 1}.get(set_name)
    safe = set_name != "accelerate-plain-bin"
    set_seed(SEED)
    plugin = None
    if fsdp_version:
        _patch_accelerate_fsdp_on_cpu()
        if fsdp_version == 1:
            _patch_fsdp1_offload_to_cpu_on_cpu()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=fsdp_version,
            state_dict_type="FULL_STATE_DICT",
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            **({"reshard_after_forward": True} if fsdp_version == 2 else {"sharding_strategy": "FULL_SHARD"}),
        )
    accelerator = Accelerator(
        cpu=True,  # MULTI_CPU + gloo under torchrun (DDP; the FSDP patch turns it into FSDP)
        fsdp_plugin=plugin,
        gradient_accumulation_steps=ACC_GRAD_ACCUM,
        project_config=ProjectConfiguration(project_dir="ckpts", automatic_checkpoint_naming=True),
    )
    expected = "FSDP" if fsdp_version else "MULTI_CPU"
    assert accelerator.distributed_type.value == expected, accelerator.distributed_type
    model = tiny_llama()
    data = TokenDataset(ACC_BATCHES_PER_EPOCH * ACC_BATCH * WORLD_SIZE)
    dl = torch.utils.data.DataLoader(data, batch_size=ACC_BATCH, shuffle=False)

    def make_opt(params):
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        return opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.5, total_iters=20)

    if fsdp_version == 1:
        model = accelerator.prepare(model)
        optimizer, scheduler = make_opt(model.parameters())
        optimizer, dl, scheduler = accelerator.prepare(optimizer, dl, scheduler)
    else:
        optimizer, scheduler = make_opt(model.parameters())
        model, optimizer, dl, scheduler = accelerator.prepare(model, optimizer, dl, scheduler)

    records: dict[str, dict] = {}
    opt_step = micro = epoch = 0
    last = max(ACC_SAVE_AFTER)
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
                    loc = accelerator.save_state(safe_serialization=safe)
                    records[os.path.relpath(loc, ".")] = {
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
    common = [
        f"gradient_accumulation_steps={ACC_GRAD_ACCUM}, {ACC_BATCHES_PER_EPOCH} micro-batches of {ACC_BATCH} per "
        "rank per epoch, no shuffling; accelerate forces a sync at the end of each dataloader epoch, so the 4th "
        "optimizer step of each epoch accumulates one micro-batch only (as in accelerate-fsdp2).",
        "random_states_<rank>.pkl['step'] is Accelerator.step: micro-batches since the current dataloader epoch "
        "began (reset to 0 on the epoch's last batch), NOT the optimizer step. checkpoint_<i> counts saves.",
        "LinearLR prepared by accelerate: AcceleratedScheduler steps the wrapped scheduler num_processes times per "
        "optimizer step (split_batches=False), so scheduler.bin last_epoch = 2 * optimizer_step.",
        "AdamW(lr=1e-2, weight_decay=0.01); optimizer.bin state 'step' per parameter = optimizer steps taken "
        "(recorded per checkpoint as optimizer_bin_step).",
    ]
    if fsdp_version:
        notes = [
            f"FSDP{fsdp_version} via accelerate on {WORLD_SIZE} CPU ranks (gloo); state_dict_type=FULL_STATE_DICT; "
            "transformer_based_wrap on LlamaDecoderLayer. accelerate writes the gathered model with torch.save on "
            "rank 0 as pytorch_model_fsdp.bin (model index 0; the name has no _0 for FSDP1 or FSDP2) and the "
            "gathered optimizer state as optimizer.bin.",
            "optimizer.bin is the full (unsharded) optimizer state dict, keyed by parameter name (FQN), not by "
            "index: "
            + (
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(full_state_dict=True, "
                "cpu_offload=True, broadcast_from_rank0=True)."
                if fsdp_version == 2
                else "FSDP.optim_state_dict(model, optimizer) under FULL_STATE_DICT (rank0_only, offload_to_cpu)."
            ),
            *common,
            "CPU patch: AcceleratorState.distributed_type forced to DistributedType.FSDP and fsdp_plugin attached "
            "after AcceleratorState.__init__ (accelerate enables FSDP only for accelerator device types) "
            "[hf_accelerate._patch_accelerate_fsdp_on_cpu]"
            + (
                "; and state.device set from cpu:0 to cpu, because FSDP1 refuses device_id cpu:0 when "
                "torch.cpu.current_device() is 'cpu'. CPU patch: torch FSDP1 FlatParamHandle.to_cpu() (entered by "
                "FULL_STATE_DICT with offload_to_cpu=True, which accelerate sets when num_processes > 1) is a no-op "
                "when the handle's device is already the CPU; unpatched, it 'moves' the unsharded flat parameter "
                "onto itself and then frees that same storage, and model.state_dict() fails with 'setStorage: ... "
                "out of bounds for storage of size 0'."
                if fsdp_version == 1
                else "."
            ),
        ]
    else:
        notes = [
            f"accelerate without FSDP: DDP on {WORLD_SIZE} CPU ranks (gloo; Accelerator(cpu=True) under torchrun). "
            + (
                "save_state() -> model.safetensors (safetensors, metadata format=pt)"
                if safe
                else "save_state(safe_serialization=False) -> pytorch_model.bin (torch.save)"
            )
            + ", optimizer.bin (model.state_dict of torch.optim.AdamW, keyed by parameter index), scheduler.bin, "
            "random_states_<rank>.pkl; rank 0 writes everything but its own RNG file.",
            "save_state writes get_state_dict(model, unwrap=False) of the models in Accelerator._models, which "
            "holds the model as handed to prepare() (not the DDP wrapper): the keys have no 'module.' prefix "
            "(model.embed_tokens.weight, ...), although the prepared model's own state_dict() has one. The file "
            "is written on rank 0 only.",
            *common,
            "No CPU patch.",
        ]
    return {"checkpoints": records, "notes": notes, "versions": versions()}


def oracle_accelerate(set_name: str, checkpoints: dict) -> dict:
    """Read the saved files as accelerate's own loading code does, plus the counters they record."""
    import torch
    from safetensors.torch import load_file

    odir = Path("oracle")
    odir.mkdir(exist_ok=True)
    out = {}
    for rel, info in checkpoints.items():
        ck = Path(rel)
        files = sorted(p.name for p in ck.iterdir())
        if set_name.endswith("-full"):
            # load_fsdp_model: torch.load(input_model_file, weights_only=True) under FULL_STATE_DICT
            wfile = ck / "pytorch_model_fsdp.bin"
            sd = torch.load(wfile, map_location="cpu", weights_only=True)
            tool = "torch.load(pytorch_model_fsdp.bin, weights_only=True) (accelerate load_fsdp_model, FULL_STATE_DICT)"
        elif set_name == "accelerate-plain":
            wfile = ck / "model.safetensors"
            sd = load_file(wfile)
            tool = "safetensors.torch.load_file(model.safetensors) (accelerate load_accelerator_state)"
        else:
            wfile = ck / "pytorch_model.bin"
            sd = torch.load(wfile, map_location="cpu", weights_only=True)
            tool = "torch.load(pytorch_model.bin, weights_only=True) (accelerate load_accelerator_state)"
        target = odir / f"{ck.name}.safetensors"
        aliases = _save_state_dict(sd, target)
        opt = torch.load(ck / "optimizer.bin", map_location="cpu", weights_only=True)
        sched = torch.load(ck / "scheduler.bin", map_location="cpu", weights_only=True)
        rng = {p.name: _load(p)["step"] for p in sorted(ck.glob("random_states_*.pkl"))}
        entry = {
            "oracle": str(target),
            "oracle_tool": tool,
            "oracle_keys": list(sd.keys()),
            "files": files,
            "weights_file": wfile.name,
            "optimizer_bin_step": optimizer_steps(opt),
            "optimizer_bin_state_keys": _state_keys(opt),
            "scheduler_bin": {"last_epoch": sched.get("last_epoch"), "_step_count": sched.get("_step_count")},
            "random_states_step": rng,
        }
        if aliases:
            entry["oracle_aliases"] = aliases
        steps = entry["optimizer_bin_step"]
        if steps != [float(info["optimizer_step"])]:
            raise RuntimeError(f"{rel}: optimizer.bin step {steps} != optimizer_step {info['optimizer_step']}")
        out[rel] = entry
    return out


# --------------------------------------------------------------------------------------------
# transformers Trainer sets (1 process)
# --------------------------------------------------------------------------------------------


def _trainer_args(**kw):
    from transformers import TrainingArguments

    base = dict(
        output_dir="ckpts",
        max_steps=TRAINER_MAX_STEPS,
        per_device_train_batch_size=TRAINER_BATCH,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=TRAINER_SAVE_EVERY,
        report_to="none",
        seed=SEED,
        data_seed=SEED,
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=True,
    )
    base.update(kw)
    return TrainingArguments(**base)


def _trainer_file_counters(ck: Path) -> dict:
    import torch

    out: dict = {"files": sorted(p.name for p in ck.iterdir())}
    ts = ck / "trainer_state.json"
    if ts.exists():
        st = json.loads(ts.read_text())
        out["trainer_state"] = {k: st.get(k) for k in ("global_step", "epoch", "max_steps", "save_steps")}
    if (ck / "optimizer.pt").exists():
        opt = torch.load(ck / "optimizer.pt", map_location="cpu", weights_only=True)
        out["optimizer_pt_step"] = optimizer_steps(opt)
    if (ck / "scheduler.pt").exists():
        sched = torch.load(ck / "scheduler.pt", map_location="cpu", weights_only=True)
        out["scheduler_pt"] = {"last_epoch": sched.get("last_epoch"), "_step_count": sched.get("_step_count")}
    return out


def _bin_merged(ck: Path) -> dict:
    """The .bin file(s) of a save_pretrained folder, torch.load-ed and merged."""
    import torch

    index = ck / "pytorch_model.bin.index.json"
    names = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["pytorch_model.bin"]
    )
    merged = {}
    for n in names:
        merged.update(torch.load(ck / n, map_location="cpu", weights_only=True))
    return merged


def work_transformers4(set_name: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback

    sharded = set_name == "transformers4-bin-sharded"
    saved: list[int] = []

    class SaveShards(TrainerCallback):
        """save_pretrained with a small max_shard_size every TRAINER_SAVE_EVERY optimizer steps."""

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % TRAINER_SAVE_EVERY == 0:
                model.save_pretrained(
                    f"ckpts/checkpoint-{state.global_step}", safe_serialization=False, max_shard_size=SHARD_SIZE
                )
                saved.append(state.global_step)

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            saved.append(state.global_step)

    # logging_dir: transformers 4's default is ckpts/runs/<date-time>_<host>, pickled into training_args.bin
    # (nothing is logged there with report_to="none"); a fixed value keeps the file the same from run to run.
    kw = dict(save_safetensors=False, logging_dir="ckpts/runs")
    args = _trainer_args(save_strategy="no", **kw) if sharded else _trainer_args(**kw)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(TRAINER_DATA))
    trainer.add_callback(SaveShards() if sharded else Record())
    trainer.train()

    odir = Path("oracle")
    odir.mkdir(exist_ok=True)
    records = {}
    for step in saved:
        ck = Path(f"ckpts/checkpoint-{step}")
        # transformers' own loading: from_pretrained(checkpoint) (reads the .bin or the index + shards)
        sd = LlamaForCausalLM.from_pretrained(str(ck)).state_dict()
        merged = _bin_merged(ck)
        if set(sd) != set(merged) or any(not torch.equal(sd[k], merged[k]) for k in sd):
            raise RuntimeError(f"{ck}: from_pretrained state_dict differs from the torch.load-ed .bin file(s)")
        target = odir / f"{ck.name}.safetensors"
        aliases = _save_state_dict(sd, target)
        entry = {
            "optimizer_step": step,
            "source": "trainer.state.global_step (on_step_end callback that saves)"
            if sharded
            else "trainer.state.global_step (on_save callback)",
            "oracle": str(target),
            "oracle_tool": "LlamaForCausalLM.from_pretrained(checkpoint).state_dict() (equal to the merged "
            "torch.load(weights_only=True) of the .bin file(s))",
            "oracle_keys": list(sd.keys()),
            **_trainer_file_counters(ck),
        }
        if aliases:
            entry["oracle_aliases"] = aliases
        if not sharded and entry["trainer_state"]["global_step"] != step:
            raise RuntimeError(f"{ck}: trainer_state.json global_step != {step}")
        records[str(ck)] = entry

    notes = [
        f"transformers {md.version('transformers')} Trainer, 1 process on CPU (use_cpu=True), max_steps="
        f"{TRAINER_MAX_STEPS}, per_device_train_batch_size={TRAINER_BATCH}, gradient_accumulation_steps=1, "
        f"AdamW (adamw_torch) lr=1e-2, weight_decay=0.01, linear schedule, seed={SEED}, data_seed={SEED}, "
        f"{TRAINER_DATA} random sequences.",
        "optimizer_step = trainer.state.global_step at the save (the checkpoint-N suffix).",
        "Oracle: LlamaForCausalLM.from_pretrained(checkpoint).state_dict(), checked equal to the merged "
        "torch.load(weights_only=True) of the .bin file(s).",
        "transformers 4 writes straight into checkpoint-N (no temporary folder + rename): the model files and "
        "config.json first, then training_args.bin, optimizer.pt, scheduler.pt, rng_state.pth, and "
        "trainer_state.json last.",
        "logging_dir='ckpts/runs' (transformers 4's default holds the date-time and host name and would make "
        "training_args.bin differ from run to run; nothing is written there with report_to='none').",
        "No CPU patch.",
    ]
    if sharded:
        notes[0:0] = [
            "transformers 4's Trainer._save calls save_pretrained without max_shard_size (default 5GB), so it "
            "never shards a small model: this set uses the same Trainer run with save_strategy='no' and a "
            "TrainerCallback.on_step_end that calls model.save_pretrained('ckpts/checkpoint-N', "
            f"safe_serialization=False, max_shard_size='{SHARD_SIZE}') every {TRAINER_SAVE_EVERY} optimizer "
            "steps. Each checkpoint-N holds config.json, generation_config.json, pytorch_model-0000i-of-0000n.bin "
            "and pytorch_model.bin.index.json only: no trainer_state.json, optimizer or RNG files, so the step "
            "is only in the folder name.",
        ]
    else:
        notes.insert(
            0,
            "save_safetensors=False, save_steps=2: Trainer._save_checkpoint -> save_pretrained -> "
            "pytorch_model.bin (torch.save).",
        )
    return {"checkpoints": records, "notes": notes, "versions": versions()}


def work_peft() -> dict:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import Trainer, TrainerCallback

    base = tiny_llama()
    odir = Path("oracle")
    odir.mkdir(exist_ok=True)
    base_sd = {k: v.detach().clone() for k, v in base.state_dict().items()}
    _save_state_dict(base_sd, odir / "base_model.safetensors")
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **LORA_CONFIG))
    saved: list[int] = []

    class Record(TrainerCallback):
        def on_save(self, args, state, control, **kw):
            saved.append(state.global_step)

    trainer = Trainer(model=model, args=_trainer_args(), train_dataset=TokenDataset(TRAINER_DATA))
    trainer.add_callback(Record())
    trainer.train()

    records = {}
    for step in saved:
        ck = Path(f"ckpts/checkpoint-{step}")
        sd = load_file(ck / "adapter_model.safetensors")
        # peft's own loading: PeftModel.from_pretrained(base, checkpoint) must load the adapter as saved
        fresh = tiny_llama()
        loaded = PeftModel.from_pretrained(fresh, str(ck))
        got = get_peft_model_state_dict(loaded)
        if set(got) != set(sd) or any(not torch.equal(got[k], sd[k]) for k in sd):
            raise RuntimeError(f"{ck}: PeftModel.from_pretrained does not give back adapter_model.safetensors")
        target = odir / f"{ck.name}.safetensors"
        _save_state_dict(sd, target)
        entry = {
            "optimizer_step": step,
            "source": "trainer.state.global_step (on_save callback)",
            "oracle": str(target),
            "oracle_tool": "safetensors.torch.load_file(adapter_model.safetensors); checked: "
            "get_peft_model_state_dict(PeftModel.from_pretrained(base, checkpoint)) equals it",
            "oracle_keys": list(sd.keys()),
            **_trainer_file_counters(ck),
        }
        if entry["trainer_state"]["global_step"] != step:
            raise RuntimeError(f"{ck}: trainer_state.json global_step != {step}")
        records[str(ck)] = entry
    # the base weights are frozen: still the initial ones after training
    trained_base = {
        k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v
        for k, v in model.state_dict().items()
        if "lora_" not in k
    }
    if set(trained_base) != set(base_sd) or any(not torch.equal(trained_base[k], base_sd[k]) for k in base_sd):
        raise RuntimeError("base weights changed during LoRA training")
    notes = [
        f"transformers {md.version('transformers')} Trainer + peft {md.version('peft')} LoRA "
        f"(LoraConfig(task_type='CAUSAL_LM', {', '.join(f'{k}={v!r}' for k, v in LORA_CONFIG.items())})) on the "
        "tiny Llama, 1 process on CPU (use_cpu=True); max_steps=6, save_steps=2, per_device_train_batch_size=2, "
        "AdamW lr=1e-2, weight_decay=0.01, linear schedule.",
        "Trainer._save -> PeftModel.save_pretrained: adapter_model.safetensors (LoRA weights only, keys "
        "base_model.model.<module>.lora_A.weight / lora_B.weight: no adapter name), adapter_config.json and a "
        "model-card README.md written by peft; no config.json, no base weights. optimizer.pt holds the LoRA "
        "parameters only.",
        "oracle/base_model.safetensors: the frozen base model (LlamaForCausalLM(LlamaConfig(**model_config)) after "
        f"torch.manual_seed({SEED})), checked unchanged by training; PeftModel.from_pretrained(base, checkpoint) "
        "on it was checked to load each checkpoint's adapter exactly.",
        "No CPU patch.",
    ]
    return {"checkpoints": records, "notes": notes, "versions": versions(("peft",))}


# --------------------------------------------------------------------------------------------
# worker / parent
# --------------------------------------------------------------------------------------------


def worker(set_name: str) -> None:
    import torch

    torch.use_deterministic_algorithms(True)
    if set_name in TORCHRUN_SETS:
        result = work_accelerate(set_name)
    elif set_name in TF4_SETS:
        import transformers

        if not transformers.__version__.startswith("4."):
            raise SystemExit(f"{set_name} needs transformers 4, got {transformers.__version__}")
        result = work_transformers4(set_name)
    elif set_name == "peft-lora":
        result = work_peft()
    else:
        raise SystemExit(f"unknown set {set_name}")
    result["python"] = sys.version.split()[0]
    if _rank() == 0:
        _write_json(Path("_worker.json"), result)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def produce(set_name: str, out: Path, timeout: float, keep_logs: bool, tf4_python: str) -> None:
    set_dir = (out / set_name).resolve()
    if set_dir.exists():
        shutil.rmtree(set_dir)
    set_dir.mkdir(parents=True)
    script = str(Path(__file__).resolve())
    python = tf4_python if set_name in TF4_SETS else sys.executable
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore"),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "ACCELERATE_DISABLE_RICH": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
    )
    logs = Path(tempfile.mkdtemp(prefix=f"producer-{set_name}-"))
    distributed = set_name in TORCHRUN_SETS
    for attempt in range(2):
        if distributed:
            cmd = [
                python, "-m", "torch.distributed.run",
                "--nproc-per-node", str(WORLD_SIZE), "--nnodes", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                script, "_worker", "--set", set_name,
            ]  # fmt: skip
        else:
            cmd = [python, script, "_worker", "--set", set_name]
        try:
            # cwd = the set folder, relative paths: recorded paths (training_args.bin output_dir) stay relative
            _run(cmd, env, timeout, logs / "worker.log", cwd=set_dir)
            break
        except RuntimeError as e:
            text = (logs / "worker.log").read_text(errors="replace").lower()
            retry = "address already in use" in str(e).lower() or "terminate called without an active" in text
            if attempt == 0 and distributed and retry:
                shutil.rmtree(set_dir)
                set_dir.mkdir(parents=True)
                continue
            raise
    result = json.loads((set_dir / "_worker.json").read_text())
    (set_dir / "_worker.json").unlink()
    checkpoints = result["checkpoints"]
    if distributed:
        (set_dir / "_ckpts.json").write_text(json.dumps(checkpoints))
        _run([python, script, "_oracle", "--set", set_name], env, timeout, logs / "oracle.log", cwd=set_dir)
        oracles = json.loads((set_dir / "_oracle.json").read_text())
        (set_dir / "_oracle.json").unlink()
        (set_dir / "_ckpts.json").unlink()
        checkpoints = {rel: {**info, **oracles[rel]} for rel, info in checkpoints.items()}
    for rel in checkpoints:
        if not (set_dir / rel).is_dir():
            raise RuntimeError(f"{set_name}: checkpoint folder {rel} missing")
    notes = list(result["notes"])
    if set_name in SAME_RUN_AS:
        note = _compare_oracles(set_dir / "oracle", SAME_RUN_AS[set_name])
        if note:
            notes.append(note)
    sub = "torchrun --nproc-per-node 2 (gloo) " if distributed else ""
    producer = {
        "set": set_name,
        "versions": result["versions"],
        "python": result["python"],
        "world_size": WORLD_SIZE if distributed else 1,
        "seed": SEED,
        "command": (
            ".venv/bin/python tests/producers/trainers/bin_folders.py --out tests/fixtures/trainers "
            f"--set {set_name}"
            + (" --tf4-python .venv-fixtures-tf4/bin/python" if set_name in TF4_SETS else "")
            + f"  (runs {sub}tests/producers/trainers/bin_folders.py _worker --set {set_name} with cwd = "
            "the set folder" + ("; then _oracle in one process" if distributed else "") + ")"
        ),
        "env": {"OMP_NUM_THREADS": "1"},
        "model": f"LlamaForCausalLM(LlamaConfig(**model_config)) after torch.manual_seed({SEED}); random token "
        "data (TokenDataset of hf_accelerate.py: seq len 16, torch.Generator seed 1235), labels = input_ids",
        "model_config": MODEL_CONFIG,
        **({"lora_config": {"task_type": "CAUSAL_LM", **LORA_CONFIG}} if set_name == "peft-lora" else {}),
        "checkpoints": checkpoints,
        "notes": notes,
    }
    _write_json(set_dir / "producer.json", producer)
    if keep_logs:
        print(f"{set_name}: logs in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    print(f"{set_name}: {len(checkpoints)} checkpoints, {_dir_bytes(set_dir)} bytes -> {set_dir}")


# Sets that run the same seeded training as another set: their weights at equal checkpoints are compared.
SAME_RUN_AS = {
    "accelerate-fsdp2-full": "accelerate-fsdp2",
    "accelerate-fsdp1-full": "accelerate-fsdp1",
    "accelerate-plain": "accelerate-fsdp2",
    "accelerate-plain-bin": "accelerate-plain",
    "transformers4-bin-sharded": "transformers4-bin",
}


def _compare_oracles(mine: Path, other_set: str) -> str | None:
    """The largest weight difference to the other set's oracle at each checkpoint of the same name."""
    from safetensors.torch import load_file

    other = mine.parent.parent / other_set / "oracle"
    parts = []
    for p in sorted(mine.glob("checkpoint*.safetensors")):
        q = other / p.name
        if not q.exists():
            continue
        a, b = load_file(p), load_file(q)
        if a.keys() != b.keys():
            parts.append(f"{p.stem}: different keys")
            continue
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
        parts.append(f"{p.stem}: " + ("identical" if diff == 0 else f"max |diff| {diff:.3g}"))
    if not parts:
        return None
    return (
        f"Same seeded training as {other_set}; weights against its oracle at the same checkpoint: "
        + ", ".join(parts)
        + "."
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_worker", "_oracle"):
        sub = sys.argv[1]
        p = argparse.ArgumentParser()
        p.add_argument("--set", required=True)
        a = p.parse_args(sys.argv[2:])
        if sub == "_worker":
            worker(a.set)
        else:
            cks = json.loads(Path("_ckpts.json").read_text())
            _write_json(Path("_oracle.json"), oracle_accelerate(a.set, cks))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--set", default="all", help="all, or comma-separated: " + ", ".join(SETS))
    p.add_argument(
        "--tf4-python",
        default=str(REPO / ".venv-fixtures-tf4" / "bin" / "python"),
        help="interpreter with transformers 4 (requirements-tf4.txt) for the transformers4-* sets",
    )
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
            produce(n, a.out, a.timeout, a.keep_logs, a.tf4_python)
        except Exception as e:  # report every set, then fail
            failed.append(n)
            print(f"{n}: FAILED\n{e}", file=sys.stderr)
    if failed:
        raise SystemExit(f"failed sets: {failed}")


if __name__ == "__main__":
    main()
