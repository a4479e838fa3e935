"""Produce checkpoints whose optimizer step is recorded in a trainer's own place (safetensors
header metadata, ``iter_num``/``step_count``, Composer's ``Timestamp``, OLMo-core's
``train/rank0.pt``, mmengine's ``meta``, Lightning's manual-optimization ``global_step``) as test
fixtures, each beside an ``oracle/`` folder holding the model weights of every checkpoint as the
framework's own loading code reads them.

Run from the repository root with the producers' virtualenv (torch CPU, litgpt, mosaicml installed
without its dependencies, ai2-olmo-core, mmengine, pytorch-lightning, safetensors)::

    .venv-fixtures/bin/python tests/producers/trainers/step_records.py \\
        --out tests/fixtures/trainers --set all

``--set`` takes ``all`` or a comma-separated list of: kohya-metadata, litgpt-pretrain,
litgpt-iter-names, composer-style, olmo-core-style, mmengine-runner, lightning-gan. Each set is
written into ``OUT/<set>/`` (deleted first; nothing else is touched). Training, the oracles and
the per-checkpoint records run in one child process per set (``--worker``), a plain Python
process with the set folder as working directory and relative output folders,
``OMP_NUM_THREADS=1``; the parent only writes ``producer.json``. Each set holds:

* the checkpoint files exactly as the saving code wrote them (symlinks kept as symlinks), less the
  logs a trainer writes beside them (each removal is listed in the set's notes);
* ``oracle/<name>.safetensors``: the model state dict as the framework's own loading code gets it
  from that checkpoint (tensors cloned and contiguous);
* ``producer.json``: set, versions, command, ``framework`` (``real``, or ``style_of`` where the
  trainer is not installable with torch 2.13: then a loop written for the fixture calls the same
  torch/safetensors APIs with the trainer's structure), ``checkpoints`` (per checkpoint:
  ``optimizer_step``, ``counters`` (every step-like counter the checkpoint records, by dotted
  path), ``name_counts``, ``oracle``, ``load_call``, and file facts), ``notes`` and ``cpu_patches``.

Which trainers are real: litgpt 0.5.13 (its ``litgpt pretrain`` command), mosaicml (Composer)
0.32.1, ai2-olmo-core 3.0.0 (its ``Trainer``), mmengine 0.10.7 (its ``Runner``) and
pytorch-lightning 2.6.6. In the style of: kohya-ss sd-scripts (not on PyPI) and the older
lit-gpt ``pretrain/openwebtext.py`` loop (lit-gpt was never on PyPI; it runs on the real
Lightning Fabric and litgpt's ``GPT``).

Composer 0.32.1 pins torch<2.7.1 and torchvision; it is installed with ``--no-deps`` beside the
few pure-Python packages it imports, and torchvision (whose PyPI wheel is a CUDA build that
cannot load beside the CPU torch) is replaced by stub modules: an import hook hands out empty
``torchvision.*`` modules whose attributes are placeholder classes (Composer imports
``torchvision.transforms``, ``torchvision.datasets.VisionDataset`` and more at import time; no
code path used here calls them). torchmetrics is imported before the hook, so its optional-package
checks see no torchvision. No Composer code is changed.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_common import TORCHRUN_VARS as _TORCHRUN_VARS
from fixture_common import (
    fresh_set_dir,
    optimizer_step_of,
    package_versions,
    run_producer,
    run_worker,
    torch_file_facts,
    write_oracle,
)

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

THIS = Path(__file__).resolve()
SCRIPT_REL = "tests/producers/trainers/step_records.py"
SEED = 1234
WORKER_RECORD = "_worker.json"  # what the child process found; read and removed by the parent

SETS: dict[str, dict] = {
    "kohya-metadata": {"kind": "kohya"},
    "litgpt-pretrain": {"kind": "litgpt"},
    "litgpt-iter-names": {"kind": "litgpt_iter"},
    "composer-style": {"kind": "composer"},
    "olmo-core-style": {"kind": "olmo"},
    "mmengine-runner": {"kind": "mmengine"},
    "lightning-gan": {"kind": "lightning_gan"},
}

# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def check(cond: bool, message: str) -> None:
    if not cond:
        raise RuntimeError(message)


def save_record(set_dir: Path, checkpoints: dict, **extra) -> None:
    (set_dir / WORKER_RECORD).write_text(json.dumps({"checkpoints": checkpoints, **extra}, default=str))


def remove_paths(set_dir: Path, rels: list[str]) -> list[str]:
    """Delete logs/caches a trainer wrote into the set; the relative paths removed."""
    removed = []
    for rel in rels:
        p = set_dir / rel
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            removed.append(rel + "/")
        elif p.exists() or p.is_symlink():
            p.unlink()
            removed.append(rel)
    return removed


# ---------------------------------------------------------------------------------------------
# kohya-ss sd-scripts style LoRA training: safetensors files, step only in __metadata__
# ---------------------------------------------------------------------------------------------

KOHYA_ARGS = {
    "pretrained_model_name_or_path": "tiny-sd-v1",
    "output_dir": "output",
    "output_name": None,  # sd-scripts' default: "last"
    "save_model_as": "safetensors",
    "save_precision": "fp16",
    "save_every_n_epochs": 1,
    "max_train_epochs": 3,
    "train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "network_module": "networks.lora",
    "network_dim": 4,
    "network_alpha": 1.0,
    "learning_rate": 1e-3,
    "unet_lr": 2e-2,
    "text_encoder_lr": 1e-2,
    "optimizer_type": "AdamW",
    "lr_scheduler": "constant",
    "max_grad_norm": 1.0,
    "mixed_precision": "no",
    "resolution": "16,16",
    "seed": SEED,
    "num_train_images": 12,
}


class TinyCLIPAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x):
        return self.out_proj(F.scaled_dot_product_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class TinyCLIPMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TinyCLIPLayer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim)
        self.self_attn = TinyCLIPAttention(dim)
        self.layer_norm2 = nn.LayerNorm(dim)
        self.mlp = TinyCLIPMLP(dim)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class TinyTextEncoder(nn.Module):
    """CLIPTextModel's module names: text_model.embeddings / encoder.layers.N / final_layer_norm."""

    def __init__(self, vocab: int = 32, dim: int = 8, max_len: int = 6) -> None:
        super().__init__()
        self.text_model = nn.Module()
        self.text_model.embeddings = nn.Module()
        self.text_model.embeddings.token_embedding = nn.Embedding(vocab, dim)
        self.text_model.embeddings.position_embedding = nn.Embedding(max_len, dim)
        self.text_model.encoder = nn.Module()
        self.text_model.encoder.layers = nn.ModuleList([TinyCLIPLayer(dim)])
        self.text_model.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, ids):
        tm = self.text_model
        x = tm.embeddings.token_embedding(ids) + tm.embeddings.position_embedding.weight[: ids.shape[1]]
        for layer in tm.encoder.layers:
            x = layer(x)
        return tm.final_layer_norm(x)


class TinyCrossAttention(nn.Module):
    """diffusers Attention names: to_q, to_k, to_v, to_out.0."""

    def __init__(self, dim: int, context_dim: int) -> None:
        super().__init__()
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(context_dim, dim, bias=False)
        self.to_v = nn.Linear(context_dim, dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

    def forward(self, x, context=None):
        context = x if context is None else context
        y = F.scaled_dot_product_attention(self.to_q(x), self.to_k(context), self.to_v(context))
        return self.to_out[1](self.to_out[0](y))


class TinyGEGLU(nn.Module):
    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def forward(self, x):
        h, gate = self.proj(x).chunk(2, dim=-1)
        return h * F.gelu(gate)


class TinyFeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([TinyGEGLU(dim, 2 * dim), nn.Dropout(0.0), nn.Linear(2 * dim, dim)])

    def forward(self, x):
        for m in self.net:
            x = m(x)
        return x


class TinyBasicTransformerBlock(nn.Module):
    def __init__(self, dim: int, context_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = TinyCrossAttention(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = TinyCrossAttention(dim, context_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = TinyFeedForward(dim)

    def forward(self, x, context):
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nn.Module):
    """The class name sd-scripts' LoRA targets in the U-Net (proj_in/proj_out are 1x1 convs, as
    in SD 1.x)."""

    def __init__(self, channels: int, context_dim: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, channels)
        self.proj_in = nn.Conv2d(channels, channels, 1)
        self.transformer_blocks = nn.ModuleList([TinyBasicTransformerBlock(channels, context_dim)])
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x, context):
        b, c, h, w = x.shape
        y = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)
        for block in self.transformer_blocks:
            y = block(y, context)
        return x + self.proj_out(y.transpose(1, 2).reshape(b, c, h, w))


class TinyUNet(nn.Module):
    """UNet2DConditionModel-shaped toy: conv_in, down_blocks.0.attentions.0 (a Transformer2DModel),
    conv_out."""

    def __init__(self, in_channels: int = 4, channels: int = 8, context_dim: int = 8) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, channels, 3, padding=1)
        block = nn.Module()
        block.attentions = nn.ModuleList([Transformer2DModel(channels, context_dim)])
        self.down_blocks = nn.ModuleList([block])
        self.conv_out = nn.Conv2d(channels, in_channels, 3, padding=1)

    def forward(self, x, context):
        x = self.conv_in(x)
        for block in self.down_blocks:
            for attn in block.attentions:
                x = attn(x, context)
        return self.conv_out(x)


class LoRAModule(nn.Module):
    """sd-scripts networks/lora.py LoRAModule: lora_down/lora_up (conv for conv targets), an
    'alpha' buffer, scale = alpha / dim; it replaces the original module's forward."""

    def __init__(self, lora_name: str, org_module: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float = 1.0) -> None:
        super().__init__()
        self.lora_name = lora_name
        if isinstance(org_module, nn.Conv2d):
            self.lora_down = nn.Conv2d(org_module.in_channels, lora_dim, org_module.kernel_size,
                                       org_module.stride, org_module.padding, bias=False)
            self.lora_up = nn.Conv2d(lora_dim, org_module.out_channels, (1, 1), (1, 1), bias=False)
        else:
            self.lora_down = nn.Linear(org_module.in_features, lora_dim, bias=False)
            self.lora_up = nn.Linear(lora_dim, org_module.out_features, bias=False)
        alpha = lora_dim if alpha is None or alpha == 0 else alpha
        self.scale = alpha / lora_dim
        self.register_buffer("alpha", torch.tensor(alpha))  # saved beside the weights
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)
        self.multiplier = multiplier
        self.org_module = [org_module]  # a list: not a registered submodule

    def apply_to(self) -> None:
        self.org_forward = self.org_module[0].forward
        self.org_module[0].forward = self.forward
        del self.org_module

    def forward(self, x):
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.multiplier * self.scale


class LoRANetwork(nn.Module):
    """LoRA modules for the text encoder ('lora_te_') and U-Net ('lora_unet_') target classes,
    added as children named by lora_name, as sd-scripts' LoRANetwork does."""

    UNET_TARGET_REPLACE_MODULE = ("Transformer2DModel",)
    TEXT_ENCODER_TARGET_REPLACE_MODULE = ("TinyCLIPAttention", "TinyCLIPMLP")  # CLIPAttention, CLIPMLP
    LORA_PREFIX_UNET = "lora_unet"
    LORA_PREFIX_TEXT_ENCODER = "lora_te"

    def __init__(self, text_encoder: nn.Module, unet: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float = 1.0) -> None:
        super().__init__()

        def create_modules(prefix: str, root: nn.Module, targets: tuple[str, ...]) -> list[LoRAModule]:
            loras = []
            for name, module in root.named_modules():
                if type(module).__name__ in targets:
                    for child_name, child in module.named_modules():
                        is_linear = isinstance(child, nn.Linear)
                        is_conv2d_1x1 = isinstance(child, nn.Conv2d) and child.kernel_size == (1, 1)
                        if is_linear or is_conv2d_1x1:
                            lora_name = (prefix + "." + name + "." + child_name).replace(".", "_")
                            loras.append(LoRAModule(lora_name, child, multiplier, lora_dim, alpha))
            return loras

        self.text_encoder_loras = create_modules(
            self.LORA_PREFIX_TEXT_ENCODER, text_encoder, self.TEXT_ENCODER_TARGET_REPLACE_MODULE
        )
        self.unet_loras = create_modules(self.LORA_PREFIX_UNET, unet, self.UNET_TARGET_REPLACE_MODULE)
        names = set()
        for lora in self.text_encoder_loras + self.unet_loras:
            check(lora.lora_name not in names, f"duplicated lora name: {lora.lora_name}")
            names.add(lora.lora_name)
            self.add_module(lora.lora_name, lora)

    def apply_to(self) -> None:
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.apply_to()

    def prepare_optimizer_params(self, text_encoder_lr: float, unet_lr: float) -> list[dict]:
        def params(loras):
            return [p for lora in loras for p in lora.parameters()]

        return [{"params": params(self.text_encoder_loras), "lr": text_encoder_lr},
                {"params": params(self.unet_loras), "lr": unet_lr}]

    def save_weights(self, file: str, dtype: torch.dtype | None, metadata: dict | None) -> None:
        from safetensors.torch import save_file

        if metadata is not None and len(metadata) == 0:
            metadata = None
        state_dict = self.state_dict()
        if dtype is not None:
            for key in list(state_dict.keys()):
                state_dict[key] = state_dict[key].detach().clone().to("cpu").to(dtype)
        if metadata is None:
            metadata = {}
        model_hash, legacy_hash = precalculate_safetensors_hashes(state_dict, metadata)
        metadata["sshs_model_hash"] = model_hash
        metadata["sshs_legacy_hash"] = legacy_hash
        save_file(state_dict, file, metadata)


def precalculate_safetensors_hashes(tensors: dict, metadata: dict) -> tuple[str, str]:
    """The hashes sd-scripts precomputes for sd-webui-additional-networks: sha256 of the file body
    (after the header) with only the 'ss_' metadata, and a 'legacy' hash of 64 KiB at 1 MiB."""
    import safetensors.torch

    metadata = {k: v for k, v in metadata.items() if k.startswith("ss_")}
    b = io.BytesIO(safetensors.torch.save(tensors, metadata))
    header_len = int.from_bytes(b.read(8), "little")
    b.seek(header_len + 8)
    model_hash = hashlib.sha256(b.read()).hexdigest()
    b.seek(0x100000)
    legacy_hash = hashlib.sha256(b.read(0x10000)).hexdigest()[0:8]
    return model_hash, legacy_hash


def sai_model_spec(title: str, timestamp: float) -> dict:
    """The 'modelspec.*' keys sd-scripts' sai_model_spec.build_metadata writes for an SD v1 LoRA
    (None values dropped)."""
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": "stable-diffusion-v1/lora",
        "modelspec.implementation": "diffusers",
        "modelspec.title": title,
        "modelspec.resolution": "16x16",
        "modelspec.date": datetime.datetime.fromtimestamp(int(timestamp)).isoformat(),
        "modelspec.prediction_type": "epsilon",
    }


def kohya_worker(set_name: str, set_dir: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    args = types.SimpleNamespace(**KOHYA_ARGS)
    if args.output_name is None:
        args.output_name = "last"
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    session_id = random.randint(0, 2**32)
    training_started_at = time.time()

    text_encoder, unet = TinyTextEncoder(), TinyUNet()
    text_encoder.requires_grad_(False)
    unet.requires_grad_(False)
    network = LoRANetwork(text_encoder, unet, 1.0, args.network_dim, args.network_alpha)
    network.apply_to()
    optimizer = torch.optim.AdamW(
        network.prepare_optimizer_params(args.text_encoder_lr, args.unet_lr), lr=args.learning_rate, weight_decay=0.01
    )

    g = torch.Generator().manual_seed(args.seed + 1)
    n = args.num_train_images
    latents = torch.randn(n, 4, 4, 4, generator=g)
    captions = torch.randint(0, 32, (n, 6), generator=g)
    batches = [(latents[i : i + args.train_batch_size], captions[i : i + args.train_batch_size])
               for i in range(0, n, args.train_batch_size)]
    num_update_steps_per_epoch = math.ceil(len(batches) / args.gradient_accumulation_steps)
    num_train_epochs = args.max_train_epochs
    max_train_steps = num_train_epochs * num_update_steps_per_epoch

    metadata = {
        "ss_session_id": session_id,
        "ss_training_started_at": training_started_at,
        "ss_output_name": args.output_name,
        "ss_learning_rate": args.learning_rate,
        "ss_text_encoder_lr": args.text_encoder_lr,
        "ss_unet_lr": args.unet_lr,
        "ss_num_train_images": n,
        "ss_num_reg_images": 0,
        "ss_num_batches_per_epoch": len(batches),
        "ss_num_epochs": num_train_epochs,
        "ss_gradient_checkpointing": False,
        "ss_gradient_accumulation_steps": args.gradient_accumulation_steps,
        "ss_max_train_steps": max_train_steps,
        "ss_lr_warmup_steps": 0,
        "ss_lr_scheduler": args.lr_scheduler,
        "ss_network_module": args.network_module,
        "ss_network_dim": args.network_dim,
        "ss_network_alpha": args.network_alpha,
        "ss_network_dropout": None,
        "ss_mixed_precision": args.mixed_precision,
        "ss_full_fp16": False,
        "ss_v2": False,
        "ss_base_model_version": "sd_v1",
        "ss_clip_skip": None,
        "ss_max_token_length": None,
        "ss_cache_latents": True,
        "ss_seed": args.seed,
        "ss_lowram": False,
        "ss_noise_offset": None,
        "ss_training_comment": None,
        "ss_sd_scripts_commit_hash": "(style of; not sd-scripts)",
        "ss_optimizer": "torch.optim.adamw.AdamW(weight_decay=0.01)",
        "ss_max_grad_norm": args.max_grad_norm,
        "ss_sd_model_name": args.pretrained_model_name_or_path,
        "ss_resolution": "(16, 16)",
        "ss_batch_size_per_device": args.train_batch_size,
        "ss_total_batch_size": args.train_batch_size * args.gradient_accumulation_steps,
        "ss_caption_dropout_rate": 0.0,
    }
    metadata = {k: str(v) for k, v in metadata.items()}
    save_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}[args.save_precision]
    record: dict[str, dict] = {}

    def save_model(ckpt_name: str, steps: int, epoch_no: int, micro_batches: int) -> None:
        os.makedirs(args.output_dir, exist_ok=True)
        ckpt_file = os.path.join(args.output_dir, ckpt_name)
        metadata["ss_training_finished_at"] = str(time.time())
        metadata["ss_steps"] = str(steps)
        metadata["ss_epoch"] = str(epoch_no)
        metadata_to_save = dict(metadata)
        metadata_to_save.update(sai_model_spec(f"{args.output_name}@{int(training_started_at)}", training_started_at))
        network.save_weights(ckpt_file, save_dtype, metadata_to_save)
        record[f"{args.output_dir}/{ckpt_name}"] = {"global_step": steps, "epoch_no": epoch_no,
                                                     "micro_batches": micro_batches}

    network.train()
    global_step = 0
    micro_batches = 0
    for epoch in range(num_train_epochs):
        metadata["ss_epoch"] = str(epoch + 1)
        for step, (lat, cap) in enumerate(batches):
            context = text_encoder(cap)
            noise = torch.randn(lat.shape, generator=g)
            noisy = lat + noise
            loss = F.mse_loss(unet(noisy, context), noise)
            (loss / args.gradient_accumulation_steps).backward()
            micro_batches += 1
            sync_gradients = (step + 1) % args.gradient_accumulation_steps == 0 or step + 1 == len(batches)
            if sync_gradients:
                torch.nn.utils.clip_grad_norm_(network.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
        if args.save_every_n_epochs is not None:
            saving = (epoch + 1) % args.save_every_n_epochs == 0 and (epoch + 1) < num_train_epochs
            if saving:
                save_model(f"{args.output_name}-{epoch + 1:06d}.{args.save_model_as}", global_step, epoch + 1,
                           micro_batches)
    save_model(f"{args.output_name}.{args.save_model_as}", global_step, num_train_epochs, micro_batches)
    check(global_step == optimizer_step_of(optimizer.state_dict()), "AdamW step != global_step")

    checkpoints = {}
    tool = "safetensors.torch.load_file(path) (sd-scripts LoRANetwork.load_weights)"
    for rel, rec in record.items():
        path = set_dir / rel
        weights = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            header_metadata = f.metadata()
        check(int(header_metadata["ss_steps"]) == rec["global_step"], f"{rel}: ss_steps")
        oracle = f"oracle/{Path(rel).name}"
        write_oracle(set_dir / oracle, weights, tool)
        checkpoints[rel] = {
            "optimizer_step": rec["global_step"],
            "counters": {
                "__metadata__.ss_steps": int(header_metadata["ss_steps"]),
                "__metadata__.ss_epoch": int(header_metadata["ss_epoch"]),
                "__metadata__.ss_max_train_steps": int(header_metadata["ss_max_train_steps"]),
                "__metadata__.ss_num_batches_per_epoch": int(header_metadata["ss_num_batches_per_epoch"]),
                "__metadata__.ss_gradient_accumulation_steps": int(header_metadata["ss_gradient_accumulation_steps"]),
            },
            "micro_batches": rec["micro_batches"],
            "name_counts": "epochs" if Path(rel).stem != args.output_name else None,
            "oracle": oracle,
            "load_call": "networks.lora: weights_sd = safetensors.torch.load_file(file); "
            "network.load_state_dict(weights_sd, False) (LoRANetwork.load_weights)",
            "metadata": header_metadata,
            "dtypes": sorted({str(v.dtype) for v in weights.values()}),
            "tensors": len(weights),
            "bytes": path.stat().st_size,
        }
    save_record(set_dir, checkpoints, versions=package_versions([]))


# ---------------------------------------------------------------------------------------------
# litgpt 0.5.13 pretrain (the real `litgpt pretrain` command)
# ---------------------------------------------------------------------------------------------

LITGPT_MODEL_CONFIG = {
    "name": "tiny-llama-like", "block_size": 16, "vocab_size": 64, "padded_vocab_size": 64, "n_layer": 1,
    "n_head": 2, "n_embd": 16, "rotary_percentage": 1.0, "parallel_residual": False, "bias": False,
    "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "intermediate_size": 32,
}
LITGPT_SAMPLES = 16  # 8 micro-batches of 2 per pass over the data: iterations 9-12 are a second pass

try:
    from litgpt.data import DataModule as _LitDataModule
except ImportError:  # pragma: no cover - the producers' venv has it
    _LitDataModule = object  # type: ignore[assignment,misc]


class StatefulTokenLoader(torch.utils.data.DataLoader):
    """A DataLoader with the state_dict/load_state_dict pair litdata's StreamingDataLoader has
    (litgpt's pretraining data modules all hand out one), so Fabric saves its state as a dict."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.current_epoch = 0
        self.num_samples_yielded = 0

    def __iter__(self):
        self.current_epoch += 1
        for batch in super().__iter__():
            self.num_samples_yielded += len(batch)
            yield batch

    def state_dict(self) -> dict:
        return {"current_epoch": self.current_epoch, "num_samples_yielded": self.num_samples_yielded}

    def load_state_dict(self, state: dict) -> None:
        self.current_epoch = state["current_epoch"]
        self.num_samples_yielded = state["num_samples_yielded"]


class RandomTokenData(_LitDataModule):  # type: ignore[misc,valid-type]
    """A litgpt DataModule of random token rows (max_seq_length + 1 tokens each)."""

    def __init__(self, vocab_size: int = 64, num_samples: int = LITGPT_SAMPLES, seed: int = SEED + 1) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_samples = num_samples
        self.seed = seed

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs) -> None:
        self.batch_size = batch_size
        self.seq_length = (max_seq_length or 16) + 1

    def setup(self, stage: str = "") -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.train_rows = torch.randint(0, self.vocab_size, (self.num_samples, self.seq_length), generator=g)
        self.val_rows = torch.randint(0, self.vocab_size, (4, self.seq_length), generator=g)

    def train_dataloader(self):
        return StatefulTokenLoader(self.train_rows, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_rows, batch_size=self.batch_size, shuffle=False)


LITGPT_CLI = [
    "litgpt", "pretrain", "tiny-llama-like",
    "--model_config", json.dumps(LITGPT_MODEL_CONFIG),
    "--out_dir", "out", "--precision", "32-true", "--devices", "1", "--logger_name", "csv", "--seed", str(SEED),
    "--data", "step_records.RandomTokenData",
    "--train.save_interval", "2", "--train.log_interval", "1", "--train.global_batch_size", "4",
    "--train.micro_batch_size", "2", "--train.max_tokens", "384", "--train.max_norm", "1.0",
    "--train.lr_warmup_steps", "1", "--train.min_lr", "0.001",
    "--eval.interval", "100", "--eval.max_iters", "1", "--eval.final_validation", "false",
    "--optimizer", json.dumps({"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "weight_decay": 0.1}}),
]


def litgpt_oracle(set_dir: Path, rel: str, tool: str) -> tuple[str, dict]:
    """litgpt.utils.load_checkpoint into GPT(Config.from_file(model_config.yaml beside it))."""
    import lightning as L
    from litgpt import Config
    from litgpt.model import GPT
    from litgpt.utils import load_checkpoint

    path = set_dir / rel
    config_file = path.parent / "model_config.yaml"
    config = Config.from_file(config_file) if config_file.exists() else Config(**LITGPT_MODEL_CONFIG)
    model = GPT(config)
    load_checkpoint(L.Fabric(accelerator="cpu", devices=1), model, path, strict=True)
    oracle = "oracle/" + rel.replace("/", "__") + ".safetensors"
    state = model.state_dict()
    write_oracle(set_dir / oracle, state, tool)
    return oracle, state


def litgpt_worker(set_name: str, set_dir: Path) -> None:
    import litgpt.__main__

    t0 = time.time()
    sys.argv = list(LITGPT_CLI)
    litgpt.__main__.main()
    train_s = round(time.time() - t0, 1)
    removed = remove_paths(set_dir, ["out/logs"])

    tool = "litgpt.utils.load_checkpoint(fabric, GPT(Config.from_file(model_config.yaml)), path) -> state_dict()"
    checkpoints = {}
    dirs = sorted(p.parent for p in (set_dir / "out").glob("*/lit_model.pth"))
    newest_step = None
    for d in dirs:
        rel = f"out/{d.name}/lit_model.pth"
        ckpt = torch.load(set_dir / rel, map_location="cpu", weights_only=False)
        step_count, iter_num = ckpt["step_count"], ckpt["iter_num"]
        check(optimizer_step_of(ckpt["optimizer"]) == step_count, f"{rel}: AdamW step != step_count")
        check(iter_num == 2 * step_count, f"{rel}: iter_num {iter_num} != 2 x step_count {step_count}")
        if d.name.startswith("step-"):
            check(int(d.name.split("-")[1]) == step_count, f"{rel}: folder name != step_count")
            newest_step = max(newest_step or 0, step_count)
        oracle, _ = litgpt_oracle(set_dir, rel, tool)
        counters = {"iter_num": iter_num, "step_count": step_count}
        if "train_dataloader" in ckpt:
            for k, v in ckpt["train_dataloader"].items():
                counters[f"train_dataloader.{k}"] = v
        counters["optimizer.state.*.step"] = optimizer_step_of(ckpt["optimizer"])
        checkpoints[rel] = {
            "optimizer_step": step_count,
            "counters": counters,
            "micro_batches": iter_num,
            "name_counts": "optimizer_steps" if d.name.startswith("step-") else None,
            "oracle": oracle,
            "load_call": "litgpt.utils.load_checkpoint(fabric, model, path): lazy_load(path).get('model', ...) "
            "then model.load_state_dict(..., strict=True); `litgpt convert_pretrained_checkpoint` keeps only "
            "['model'] for `litgpt generate`/finetune",
            "files_beside": sorted(p.name for p in d.iterdir() if p.name != "lit_model.pth"),
            **torch_file_facts(set_dir / rel),
        }
        if d.name == "final":
            checkpoints[rel]["copy_of"] = f"out/step-{step_count:08d}/lit_model.pth"
            checkpoints[rel]["copy_kind"] = "a second fabric.save of the same state after the loop (not a file copy)"
    check(newest_step == 6, f"newest step folder {newest_step}")
    save_record(set_dir, checkpoints, removed=removed, train_s=train_s,
                versions=package_versions(["litgpt", "lightning", "jsonargparse"]))


# ---------------------------------------------------------------------------------------------
# lit-gpt pretrain/openwebtext.py style (late 2023): out/<name>/iter-%06d-ckpt.pth
# ---------------------------------------------------------------------------------------------

# The training script's module-level settings; 'hparams' in the checkpoint is this dict.
LIT_ITER_SETTINGS = {
    "model_name": "tiny-llama-like",
    "name": "openwebtext",
    "save_interval": 2,
    "eval_interval": 1000,
    "eval_iters": 2,
    "log_interval": 1,
    "learning_rate": 6e-3,
    "batch_size": 4,
    "micro_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "max_iters": 12,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "decay_lr": True,
    "warmup_iters": 2,
    "lr_decay_iters": 12,
    "min_lr": 6e-4,
}


class RandomTokenStream(torch.utils.data.IterableDataset):
    """Endless random windows of an in-memory token tensor (the script's memmap Dataset, on random
    tokens instead of a train.bin file)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.block_size = block_size

    def __iter__(self):
        while True:
            i = int(torch.randint(len(self.tokens) - self.block_size, (1,)).item())
            x = self.tokens[i : i + self.block_size].to(torch.int64)
            y = self.tokens[i + 1 : i + 1 + self.block_size].to(torch.int64)
            yield x, y


def litgpt_iter_worker(set_name: str, set_dir: Path) -> None:
    import lightning as L
    from litgpt import Config
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    s = dict(LIT_ITER_SETTINGS)
    hparams = {k: v for k, v in s.items() if isinstance(v, (int, float, str))}
    out_dir = Path("out") / s["name"]
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="auto", precision="32-true")
    if fabric.global_rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    fabric.seed_everything(1337, workers=True)
    config = Config(**LITGPT_MODEL_CONFIG)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    model.apply(model._init_weights)
    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s["learning_rate"], weight_decay=s["weight_decay"],
                                  betas=(s["beta1"], s["beta2"]), foreach=False)
    optimizer = fabric.setup_optimizers(optimizer)
    g = torch.Generator().manual_seed(SEED + 1)
    train_tokens = torch.randint(0, config.vocab_size, (512,), generator=g, dtype=torch.int32)
    train_dataloader = torch.utils.data.DataLoader(RandomTokenStream(train_tokens, config.block_size),
                                                   batch_size=s["micro_batch_size"], num_workers=0)
    train_dataloader = fabric.setup_dataloaders(train_dataloader)
    state = {"model": model, "optimizer": optimizer, "hparams": hparams, "iter_num": 0, "step_count": 0}

    def get_lr(it: int) -> float:
        if it < s["warmup_iters"]:
            return s["learning_rate"] * it / s["warmup_iters"]
        if it > s["lr_decay_iters"]:
            return s["min_lr"]
        ratio = (it - s["warmup_iters"]) / (s["lr_decay_iters"] - s["warmup_iters"])
        return s["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (s["learning_rate"] - s["min_lr"])

    record: dict[str, dict] = {}
    train_iter = iter(train_dataloader)
    # The loop variable is state["iter_num"] itself (0-based); the file name uses iter_num = it + 1.
    for state["iter_num"] in range(state["iter_num"], s["max_iters"]):  # noqa: B020 (as the script does)
        lr = get_lr(state["iter_num"]) if s["decay_lr"] else s["learning_rate"]
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        iter_num = state["iter_num"] + 1
        input_ids, targets = next(train_iter)
        is_accumulating = iter_num % s["gradient_accumulation_steps"] != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets, chunk_size=0)
            fabric.backward(loss / s["gradient_accumulation_steps"])
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=s["grad_clip"])
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
        if not is_accumulating and state["step_count"] % s["save_interval"] == 0:
            checkpoint_path = out_dir / f"iter-{iter_num:06d}-ckpt.pth"
            fabric.print(f"Saving checkpoint to {str(checkpoint_path)!r}")
            fabric.save(checkpoint_path, state)
            record[str(checkpoint_path)] = {"micro_batches": iter_num, "step_count": state["step_count"],
                                            "iter_num_in_state": state["iter_num"]}

    tool = "lit-gpt: lazy_load(path).get('model') -> GPT(config).load_state_dict(strict=True) -> state_dict()"
    checkpoints = {}
    for rel, rec in record.items():
        ckpt = torch.load(set_dir / rel, map_location="cpu", weights_only=False)
        check(ckpt["iter_num"] == rec["iter_num_in_state"] and ckpt["step_count"] == rec["step_count"], rel)
        check(optimizer_step_of(ckpt["optimizer"]) == ckpt["step_count"], f"{rel}: AdamW step != step_count")
        oracle, _ = litgpt_oracle(set_dir, rel, tool)
        checkpoints[rel] = {
            "optimizer_step": ckpt["step_count"],
            "counters": {"iter_num": ckpt["iter_num"], "step_count": ckpt["step_count"],
                         "optimizer.state.*.step": optimizer_step_of(ckpt["optimizer"])},
            "micro_batches": rec["micro_batches"],
            "name_counts": "micro_batches (iter_num + 1 of the file)",
            "oracle": oracle,
            "load_call": "lit-gpt: checkpoint = lazy_load(path); model.load_state_dict(checkpoint.get('model', "
            "checkpoint)); resume: fabric.load(path, state)",
            **torch_file_facts(set_dir / rel),
        }
    save_record(set_dir, checkpoints, versions=package_versions(["litgpt", "lightning"]))


# ---------------------------------------------------------------------------------------------
# MosaicML Composer 0.32.1 (real; installed --no-deps, torchvision stubbed)
# ---------------------------------------------------------------------------------------------


class _TorchvisionStub(types.ModuleType):
    """An empty torchvision module: any attribute is a placeholder class that refuses to be built."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        owner = self.__name__

        def refuse(self_, *args, **kwargs):
            raise NotImplementedError(f"{owner}.{attr} is a stub (torchvision is not installed)")

        placeholder = type(attr, (), {"__module__": owner, "__init__": refuse})
        setattr(self, attr, placeholder)
        return placeholder


class _TorchvisionStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _TorchvisionStub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


COMPOSER_STUB_NOTE = (
    "mosaicml 0.32.1 requires torch<2.7.1 and torchvision<0.22.1: installed with pip --no-deps beside "
    "py-cpuinfo, coolname<3, tabulate==0.9.0, importlib-metadata<9, mosaicml-cli<0.8 and torch_optimizer<0.4 "
    "(the modules it imports). torchvision's PyPI wheel is a CUDA build that cannot load beside the CPU "
    "torch, so an import hook (sys.meta_path) hands out empty 'torchvision.*' modules whose attributes "
    "are placeholder classes (composer.utils.misc imports torchvision.transforms and "
    "torchvision.datasets.VisionDataset, composer.algorithms more, at import time; nothing used here "
    "calls them). torchmetrics is imported before the hook so its optional-package checks find no "
    "torchvision. Composer's own code is unchanged; the hook lives only in the producing process."
)


def import_composer():
    if importlib.util.find_spec("torchvision") is None and not any(
        isinstance(f, _TorchvisionStubFinder) for f in sys.meta_path
    ):
        import torchmetrics  # noqa: F401  (before the stub: its optional-package checks see none)

        sys.meta_path.insert(0, _TorchvisionStubFinder())
    import composer

    return composer


class TinyClassifierNet(nn.Module):
    def __init__(self, in_features: int = 6, hidden: int = 10, num_classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.net(x)


COMPOSER_SAMPLES = 16  # 4 batches of 4 per epoch: ba2, ba4 in epoch 0, ba6 in epoch 1
COMPOSER_TIMESTAMP_FIELDS = ("iteration", "epoch", "batch", "sample", "token", "epoch_in_iteration",
                             "token_in_iteration", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")


def composer_worker(set_name: str, set_dir: Path) -> None:
    composer = import_composer()
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED + 1)
    data = TensorDataset(torch.randn(COMPOSER_SAMPLES, 6, generator=g),
                         torch.randint(0, 3, (COMPOSER_SAMPLES,), generator=g))
    model = ComposerClassifier(TinyClassifierNet(), num_classes=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=4, shuffle=False),
        optimizers=optimizer,
        max_duration="6ba",
        save_folder="checkpoints",
        save_interval="2ba",
        device="cpu",
        device_train_microbatch_size=2,
        run_name="tiny-composer",
        seed=SEED,
        progress_bar=False,
        log_to_console=False,
    )
    trainer.fit()
    trainer.close()

    tool = "torch.load(path, weights_only=False)['state']['model'] (Composer: state.model.load_state_dict)"
    checkpoints = {}
    ckpt_dir = set_dir / "checkpoints"
    files = sorted(ckpt_dir.glob("ep*-ba*-rank0.pt"), key=lambda p: int(p.name.split("-ba")[1].split("-")[0]))
    for path in files:
        rel = f"checkpoints/{path.name}"
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        state = ckpt["state"]
        ts = state["timestamp"]["Timestamp"]
        batch = int(path.name.split("-ba")[1].split("-")[0])
        epoch = int(path.name[2:].split("-")[0])
        check((ts["batch"], ts["epoch"]) == (batch, epoch), f"{rel}: timestamp {ts} != name")
        check(optimizer_step_of(state["optimizers"]["AdamW"]) == ts["batch"], f"{rel}: AdamW step != batch")
        fresh = ComposerClassifier(TinyClassifierNet(), num_classes=3)
        fresh.load_state_dict(state["model"], strict=True)
        oracle = f"oracle/{path.name}.safetensors"
        write_oracle(set_dir / oracle, fresh.state_dict(), tool)
        counters = {f"state.timestamp.Timestamp.{k}": ts[k] for k in COMPOSER_TIMESTAMP_FIELDS if k in ts}
        counters["state.optimizers.AdamW.state.*.step"] = optimizer_step_of(state["optimizers"]["AdamW"])
        checkpoints[rel] = {
            "optimizer_step": ts["batch"],
            "counters": counters,
            "timestamp_wall_clock_types": {k: type(v).__name__ for k, v in ts.items() if k.endswith("_wct")},
            "micro_batches": ts["batch"] * 2,
            "name_counts": "batches (= optimizer steps) and epochs: ep{epoch}-ba{batch}-rank{rank}.pt",
            "oracle": oracle,
            "load_call": "Composer load_checkpoint: state_dict = torch.load(path, weights_only=False); "
            "state.load_state_dict(state_dict['state']) -> state.model.load_state_dict(state_dict['state']"
            "['model']) on the ComposerClassifier (keys keep 'module.')",
            "state_keys": list(state.keys()),
            "callbacks_state": state.get("callbacks"),
            **torch_file_facts(path),
        }
    latest = ckpt_dir / "latest-rank0.pt"
    check(latest.is_symlink(), "latest-rank0.pt is not a symlink")
    target = os.readlink(latest)
    entry = dict(checkpoints[f"checkpoints/{files[-1].name}"])
    entry["symlink_to"] = target
    checkpoints["checkpoints/latest-rank0.pt"] = entry
    save_record(set_dir, checkpoints, composer_version=composer.__version__,
                versions=package_versions(["mosaicml", "torchmetrics"]))


# ---------------------------------------------------------------------------------------------
# OLMo-core 3.0.0 (real Trainer + TransformerTrainModule + CheckpointerCallback)
# ---------------------------------------------------------------------------------------------

OLMO_SEQ = 16
OLMO_VOCAB = 32


def olmo_model_config():
    from olmo_core.nn.transformer import TransformerConfig

    return TransformerConfig.llama_like(d_model=8, vocab_size=OLMO_VOCAB, n_layers=1, n_heads=2,
                                        hidden_size_multiple_of=8)


def olmo_worker(set_name: str, set_dir: Path) -> None:
    import numpy as np
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.distributed.checkpoint import load_model_and_optim_state
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import CheckpointerCallback, ConfigSaverCallback
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.utils import seed_all

    seed_all(SEED)
    os.makedirs("data", exist_ok=True)
    rng = np.random.default_rng(SEED + 1)
    rng.integers(1, OLMO_VOCAB - 1, size=OLMO_SEQ * 48, dtype=np.uint16).tofile("data/tokens.npy")
    tokenizer = TokenizerConfig(vocab_size=OLMO_VOCAB, eos_token_id=OLMO_VOCAB - 1, pad_token_id=0)
    model_config = olmo_model_config()
    model = model_config.build(init_device="cpu")
    train_module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * OLMO_SEQ,  # 2 instances per micro-batch; global batch 4 -> 2 micro-batches
        max_sequence_length=OLMO_SEQ,
        optim=AdamWConfig(lr=1e-2, weight_decay=0.1),
        max_grad_norm=1.0,
    )
    train_module = train_module_config.build(model, device=torch.device("cpu"))
    dataset_config = NumpyFSLDatasetConfig(paths=["data/tokens.npy"], sequence_length=OLMO_SEQ, tokenizer=tokenizer,
                                           work_dir="work/dataset")
    dataset = dataset_config.build()
    data_loader_config = NumpyDataLoaderConfig(global_batch_size=4 * OLMO_SEQ, seed=SEED + 2, num_workers=0)
    data_loader = data_loader_config.build(dataset, dp_process_group=train_module.dp_process_group)
    trainer_config = TrainerConfig(
        save_folder="ckpts",
        work_dir="work/trainer",
        max_duration=Duration.steps(6),
        device="cpu",
        metrics_collect_interval=1,
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=2, ephemeral_save_interval=None, save_async=False,
                                                 pre_train_checkpoint=False),
            "config_saver": ConfigSaverCallback(),
        },
    )
    trainer = trainer_config.build(train_module, data_loader)
    trainer.callbacks["config_saver"].config = {
        "run_name": "tiny-olmo",
        "model": model_config.as_config_dict(),
        "dataset": dataset_config.as_config_dict(),
        "data_loader": data_loader_config.as_config_dict(),
        "train_module": train_module_config.as_config_dict(),
        "trainer": {"save_folder": "ckpts", "max_duration": "6 steps", "checkpointer.save_interval": 2},
    }
    trainer.fit()
    removed = remove_paths(set_dir, ["data", "work"])

    from torch.distributed.checkpoint import FileSystemReader

    tool = ("olmo_core.distributed.checkpoint.load_model_and_optim_state(<step>/model_and_optim, model) "
            "into model_config.build(init_device='cpu') -> model.state_dict()")
    checkpoints = {}
    for step_dir in sorted((set_dir / "ckpts").glob("step*"), key=lambda p: int(p.name[4:])):
        rel = f"ckpts/{step_dir.name}"
        train_state = torch.load(step_dir / "train" / "rank0.pt", map_location="cpu", weights_only=False)
        fresh = olmo_model_config().build(init_device="cpu")
        load_model_and_optim_state(str(step_dir / "model_and_optim"), fresh)
        oracle = f"oracle/{step_dir.name}.safetensors"
        write_oracle(set_dir / oracle, fresh.state_dict(), tool)
        metadata = FileSystemReader(str(step_dir / "model_and_optim")).read_metadata()
        step_keys = [k for k in metadata.state_dict_metadata if k.startswith("optim.state.") and k.endswith(".step")]
        storage_types = sorted({f"{type(v).__module__}.{type(v).__qualname__}" for v in metadata.storage_data.values()})
        dl = train_state["data_loader"]
        counters = {
            "train/rank0.pt:global_step": train_state["global_step"],
            "train/rank0.pt:global_train_tokens_seen": train_state["global_train_tokens_seen"],
            "train/rank0.pt:epoch": train_state["epoch"],
            "train/rank0.pt:max_steps": train_state["max_steps"],
            "train/rank0.pt:data_loader.batches_processed": dl.get("batches_processed"),
            "train/rank0.pt:data_loader.tokens_processed": dl.get("tokens_processed"),
            "train/rank0.pt:data_loader.epoch": dl.get("epoch"),
        }
        check(int(step_dir.name[4:]) == train_state["global_step"], f"{rel}: name != global_step")
        checkpoints[rel] = {
            "optimizer_step": train_state["global_step"],
            "counters": counters,
            "optimizer_step_keys_in_dcp": len(step_keys),
            "micro_batches": 2 * train_state["global_step"],
            "name_counts": "optimizer_steps (step{global_step})",
            "oracle": oracle,
            "load_call": "olmo_core.distributed.checkpoint.load_model_and_optim_state(dir/'model_and_optim', model) "
            "(Trainer.load_checkpoint -> Checkpointer.load -> train_module.load_state_dict); "
            "offline: olmo_core.distributed.checkpoint.unshard_checkpoint",
            "files": sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()),
            "metadata_json": json.loads((step_dir / ".metadata.json").read_text()),
            "dcp_storage_data_types": storage_types,
            "dcp_storage_meta_checkpoint_id": str(getattr(metadata.storage_meta, "checkpoint_id", None)),
            "dcp_keys": len(metadata.state_dict_metadata),
            "train_state_keys": list(train_state.keys()),
            "bytes": sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()),
        }
    save_record(set_dir, checkpoints, removed=removed,
                versions=package_versions(["ai2-olmo-core", "numpy"]))


# ---------------------------------------------------------------------------------------------
# mmengine 0.10.7 Runner (real), with and without EMAHook
# ---------------------------------------------------------------------------------------------

try:
    from mmengine.model import BaseModel as _MMBaseModel
except ImportError:  # pragma: no cover - the producers' venv has it
    _MMBaseModel = nn.Module  # type: ignore[assignment,misc]


class TinyMMNet(_MMBaseModel):  # type: ignore[misc,valid-type]
    """An mmengine BaseModel: Linear + BatchNorm1d (running stats, num_batches_tracked) + head."""

    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.backbone = nn.Sequential(nn.Linear(6, 10), nn.BatchNorm1d(10), nn.ReLU())
        self.head = nn.Linear(10, 3)

    def forward(self, inputs, labels=None, mode: str = "tensor"):
        out = self.head(self.backbone(inputs))
        if mode == "loss":
            return {"loss": F.mse_loss(out, labels)}
        return out


class TinyMMDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int = 12, seed: int = SEED + 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, 6, generator=g)
        self.y = torch.randn(num_samples, 3, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"inputs": self.x[i], "labels": self.y[i]}


MM_EMA_MOMENTUM = 0.25


def mmengine_cfg(work_dir: str, ema: bool) -> dict:
    cfg = dict(
        model=dict(type="TinyMMNet"),
        work_dir=work_dir,
        experiment_name="tiny",
        train_dataloader=dict(dataset=dict(type="TinyMMDataset"), sampler=dict(type="DefaultSampler", shuffle=False),
                              batch_size=4, num_workers=0, collate_fn=dict(type="default_collate")),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=1e-2, weight_decay=0.01)),
        train_cfg=dict(by_epoch=True, max_epochs=3),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1)),
        randomness=dict(seed=SEED),
        launcher="none",
        env_cfg=dict(cudnn_benchmark=False, dist_cfg=dict(backend="gloo")),
    )
    if ema:
        cfg["custom_hooks"] = [dict(type="EMAHook", momentum=MM_EMA_MOMENTUM)]
    return cfg


def mmengine_worker(set_name: str, set_dir: Path) -> None:
    import mmengine
    from mmengine.config import Config
    from mmengine.registry import DATASETS, MODELS
    from mmengine.runner import Runner
    from mmengine.runner.checkpoint import load_checkpoint

    MODELS.register_module(module=TinyMMNet, force=True)
    DATASETS.register_module(module=TinyMMDataset, force=True)
    runs = {"work_dir": False, "ema_hook/work_dir": True}
    record: dict[str, dict] = {}
    for work_dir, ema in runs.items():
        runner = Runner.from_cfg(Config(mmengine_cfg(work_dir, ema)))
        runner.train()
        record[work_dir] = {"max_iters": runner.max_iters, "iters_per_epoch": len(runner.train_dataloader)}
        del runner
    # the log folders (<timestamp>/: the .log file, vis_data/ scalars and a config copy)
    removed = remove_paths(set_dir, [str(p.relative_to(set_dir)) for wd in runs
                                     for p in sorted((set_dir / wd).iterdir()) if p.is_dir()])

    # mmengine 0.10.7 torch.loads without weights_only, and torch >= 2.6 defaults to weights_only=True,
    # which refuses mmengine's own message_hub (HistoryBuffer, numpy); torch's documented switch lets
    # mmengine's load_checkpoint read its checkpoints.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    checkpoints = {}
    for work_dir, ema in runs.items():
        wd = set_dir / work_dir
        last = (wd / "last_checkpoint").read_text().strip()
        for path in sorted(wd.glob("epoch_*.pth"), key=lambda p: int(p.stem.split("_")[1])):
            rel = f"{work_dir}/{path.name}"
            ckpt = torch.load(path, map_location="cpu", weights_only=False)
            meta = ckpt["meta"]
            runtime = ckpt["message_hub"]["runtime_info"]
            check(meta["epoch"] == int(path.stem.split("_")[1]), f"{rel}: meta.epoch != name")
            check(optimizer_step_of(ckpt["optimizer"]) == meta["iter"], f"{rel}: AdamW step != meta.iter")
            model = TinyMMNet()
            load_checkpoint(model, str(path), map_location="cpu", strict=True, logger="silent")
            oracle_base = f"oracle/{work_dir.replace('/', '__')}__{path.name}"
            loaded = model.state_dict()
            counters = {
                "meta.epoch": meta["epoch"],
                "meta.iter": meta["iter"],
                "message_hub.runtime_info.epoch": runtime["epoch"],
                "message_hub.runtime_info.iter": runtime["iter"],
                "message_hub.runtime_info.max_iters": runtime["max_iters"],
                "optimizer.state.*.step": optimizer_step_of(ckpt["optimizer"]),
                "state_dict.backbone.1.num_batches_tracked": int(ckpt["state_dict"]["backbone.1.num_batches_tracked"]),
            }
            entry = {
                "optimizer_step": meta["iter"],
                "counters": counters,
                "name_counts": "epochs (epoch_{meta.epoch}.pth)",
                "oracle": f"{oracle_base}.safetensors",
                "load_call": "mmengine.runner.load_checkpoint(model, path, map_location='cpu', strict=True) "
                "(Runner.load_checkpoint / test / deploy; with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 under torch>=2.6)",
                "is_last_checkpoint": Path(last).name == path.name,
                "message_hub_last_ckpt": runtime.get("last_ckpt"),
                **torch_file_facts(path),
            }
            if ema:
                ema_sd = ckpt["ema_state_dict"]
                counters["ema_state_dict.steps"] = int(ema_sd["steps"])
                training = {k[len("module."):]: v for k, v in ema_sd.items() if k.startswith("module.")}
                check(set(training) == set(loaded), f"{rel}: ema_state_dict keys")
                write_oracle(set_dir / entry["oracle"], loaded, "mmengine load_checkpoint -> model.state_dict() "
                             "(with EMAHook: the EMA weights, swapped into 'state_dict' at save)")
                entry["oracle_is"] = "the EMA weights (EMAHook swaps them into 'state_dict' before saving)"
                entry["oracle_training"] = f"{oracle_base}.training.safetensors"
                write_oracle(
                    set_dir / entry["oracle_training"],
                    training,
                    "ema_state_dict 'module.'-prefixed entries, prefix stripped: the raw training "
                    "weights EMAHook swapped out of 'state_dict' (what a resumed run's model holds)",
                )
                entry["ema_state_dict_keys"] = list(ema_sd.keys())
                entry["load_call_training"] = ("Runner.resume(path) with EMAHook registered: "
                                               "EMAHook.after_load_checkpoint swaps 'state_dict' and "
                                               "'ema_state_dict' back (model <- training weights, "
                                               "ema_model <- EMA)")
            else:
                write_oracle(set_dir / entry["oracle"], loaded, "mmengine load_checkpoint -> model.state_dict()")
            checkpoints[rel] = entry
        checkpoints[f"{work_dir}/last_checkpoint"] = {"text_file_names": last,
                                                      "bytes": (wd / "last_checkpoint").stat().st_size}
    versions = {**package_versions(["mmengine", "numpy"]), "mmengine (import)": mmengine.__version__}
    save_record(set_dir, checkpoints, removed=removed, runs=record, versions=versions)


# ---------------------------------------------------------------------------------------------
# pytorch-lightning 2.6.6 GAN: manual optimization, two optimizers
# ---------------------------------------------------------------------------------------------

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the producers' venv has it
    pl = None  # type: ignore[assignment]

GAN_SAMPLES = 4
GAN_BATCH = 2  # 2 batches per epoch, 2 epochs -> 4 batches, 8 optimizer.step calls

if pl is not None:

    class TinyGAN(pl.LightningModule):
        """A GAN held as self.generator and self.discriminator, trained with manual optimization."""

        def __init__(self, latent_dim: int = 4, data_dim: int = 6, lr: float = 2e-3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(latent_dim, 12), nn.LeakyReLU(0.2), nn.Linear(12, data_dim))
            self.discriminator = nn.Sequential(nn.Linear(data_dim, 12), nn.LeakyReLU(0.2), nn.Linear(12, 1))

        def forward(self, z):
            return self.generator(z)

        def training_step(self, batch, batch_idx):
            (real,) = batch
            opt_g, opt_d = self.optimizers()
            z = torch.randn(real.shape[0], self.hparams.latent_dim, device=real.device)
            ones = torch.ones(real.shape[0], 1, device=real.device)
            # generator
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
            opt_g.zero_grad()
            self.manual_backward(g_loss)
            opt_g.step()
            # discriminator
            fake = self.generator(z).detach()
            d_loss = 0.5 * (F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
                            + F.binary_cross_entropy_with_logits(self.discriminator(fake), 0 * ones))
            opt_d.zero_grad()
            self.manual_backward(d_loss)
            opt_d.step()

        def configure_optimizers(self):
            opt_g = torch.optim.AdamW(self.generator.parameters(), lr=self.hparams.lr, betas=(0.5, 0.999))
            opt_d = torch.optim.AdamW(self.discriminator.parameters(), lr=self.hparams.lr, betas=(0.5, 0.999))
            return [opt_g, opt_d]


def lightning_gan_worker(set_name: str, set_dir: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    pl.seed_everything(SEED, workers=True)
    g = torch.Generator().manual_seed(SEED + 1)
    loader = DataLoader(TensorDataset(torch.randn(GAN_SAMPLES, 6, generator=g)), batch_size=GAN_BATCH, shuffle=False)
    module = TinyGAN()
    callback = ModelCheckpoint(dirpath="ckpts", every_n_train_steps=2, save_top_k=-1)
    with tempfile.TemporaryDirectory(prefix="lightning-root-") as root:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=[callback], logger=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                             deterministic=True)
        trainer.fit(module, loader)
    batches_total = trainer.fit_loop.epoch_loop.batch_progress.total.completed

    tool = "TinyGAN.load_from_checkpoint(path).state_dict() (Lightning reads ['state_dict'])"
    checkpoints = {}
    files = sorted((set_dir / "ckpts").glob("epoch=*-step=*.ckpt"), key=lambda p: int(p.name.split("step=")[1][:-5]))
    for path in files:
        rel = f"ckpts/{path.name}"
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        loops = ckpt["loops"]["fit_loop"]
        epoch_loop = loops["epoch_loop.state_dict"]
        batch_prog = loops["epoch_loop.batch_progress"]
        optim_prog = loops["epoch_loop.manual_optimization.optim_step_progress"]
        g_steps = optimizer_step_of(ckpt["optimizer_states"][0])
        d_steps = optimizer_step_of(ckpt["optimizer_states"][1])
        check(ckpt["global_step"] == int(path.name.split("step=")[1][:-5]), f"{rel}: global_step != name")
        # the save runs in on_train_batch_end, before the batch counts as 'completed'
        check(g_steps == d_steps == batch_prog["total"]["processed"], f"{rel}: AdamW steps != batches")
        check(ckpt["global_step"] == g_steps + d_steps, f"{rel}: global_step != sum of optimizer steps")
        loaded = TinyGAN.load_from_checkpoint(str(path), map_location="cpu")
        oracle = f"oracle/{path.name}.safetensors"
        write_oracle(set_dir / oracle, loaded.state_dict(), tool)
        checkpoints[rel] = {
            "optimizer_step": g_steps,
            "optimizer_step_means": "updates applied to each parameter: one generator AdamW step and one "
            "discriminator AdamW step per batch; Lightning's global_step counts both",
            "counters": {
                "global_step": ckpt["global_step"],
                "epoch": ckpt["epoch"],
                "loops.fit_loop.epoch_loop.batch_progress.total.processed": batch_prog["total"]["processed"],
                "loops.fit_loop.epoch_loop.batch_progress.total.completed": batch_prog["total"]["completed"],
                "loops.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total.completed":
                    optim_prog["total"]["completed"],
                "loops.fit_loop.epoch_loop.state_dict._batches_that_stepped": epoch_loop.get("_batches_that_stepped"),
                "optimizer_states.0.state.*.step (generator)": g_steps,
                "optimizer_states.1.state.*.step (discriminator)": d_steps,
            },
            "batches": batch_prog["total"]["processed"],
            "name_counts": "global_step = optimizer.step() calls of both optimizers (2 per batch)",
            "oracle": oracle,
            "load_call": "TinyGAN.load_from_checkpoint(path) (LightningModule: checkpoint['state_dict'], strict)",
            **torch_file_facts(path),
        }
    save_record(set_dir, checkpoints, batches_total=batches_total, global_step_total=trainer.global_step,
                versions=package_versions(["pytorch-lightning"]))


# ---------------------------------------------------------------------------------------------
# Notes per set, launching, producer.json
# ---------------------------------------------------------------------------------------------


def set_framework(kind: str) -> dict:
    if kind == "kohya":
        return {"framework": "style_of", "style_of": "kohya-ss/sd-scripts train_network.py + networks/lora.py "
                "(not on PyPI)"}
    if kind == "litgpt_iter":
        return {
            "framework": "style_of",
            "style_of": "Lightning-AI/lit-gpt pretrain/openwebtext.py (late 2023; lit-gpt was never on PyPI), "
            "run on the real lightning Fabric 2.6.6 and litgpt 0.5.13's GPT",
        }
    real = {"litgpt": "litgpt 0.5.13 (`litgpt pretrain`)", "composer": "mosaicml (Composer) 0.32.1 Trainer",
            "olmo": "ai2-olmo-core 3.0.0 Trainer", "mmengine": "mmengine 0.10.7 Runner",
            "lightning_gan": "pytorch-lightning 2.6.6 Trainer"}
    return {"framework": "real", "real": real[kind]}


def set_notes(set_name: str, kind: str, record: dict) -> list[str]:
    removed = record.get("removed") or []
    removed_note = [f"Removed after training (logs/caches, not checkpoints): {', '.join(removed)}."] if removed else []
    if kind == "kohya":
        a = KOHYA_ARGS
        return [
            "A LoRA training loop written for this fixture in the style of sd-scripts train_network.py: a "
            "frozen toy text encoder (CLIPTextModel module names) and toy U-Net (UNet2DConditionModel names, "
            "one Transformer2DModel with 1x1-conv proj_in/proj_out), sd-scripts' LoRANetwork naming "
            "('lora_te_' + CLIPAttention/CLIPMLP linears, 'lora_unet_' + Transformer2DModel linears and 1x1 "
            "convs, dots -> underscores), LoRAModule lora_down (kaiming) / lora_up (zeros) / 'alpha' buffer.",
            f"{a['num_train_images']} images, batch {a['train_batch_size']}, gradient accumulation "
            f"{a['gradient_accumulation_steps']} -> 6 micro-batches and 3 optimizer steps per epoch; "
            f"{a['max_train_epochs']} epochs; AdamW (text encoder lr {a['text_encoder_lr']}, U-Net lr "
            f"{a['unet_lr']}), clip_grad_norm {a['max_grad_norm']}. global_step counts optimizer steps "
            "(incremented when accelerate's sync_gradients is true).",
            "save_every_n_epochs=1, output_name None -> 'last': at each epoch end but the last, "
            "'last-%06d.safetensors' % (epoch + 1) (get_epoch_ckpt_name), and after training 'last.safetensors' "
            "(get_last_ckpt_name) with ss_epoch = num_train_epochs. The last epoch writes no numbered file.",
            "save_model: metadata['ss_training_finished_at'], ['ss_steps'] = global_step, ['ss_epoch'] = epoch_no "
            "(strings, as all metadata), plus the sai model spec 'modelspec.*' keys, then "
            f"LoRANetwork.save_weights(file, {a['save_precision']}, metadata): every tensor (alpha included) cast "
            "to fp16, 'sshs_model_hash'/'sshs_legacy_hash' precomputed over the ss_-only metadata, "
            "safetensors.torch.save_file(state_dict, file, metadata).",
            "The step is only in the header's __metadata__ ('ss_steps'); the file names count epochs. "
            "ss_training_started_at/finished_at, modelspec.date and modelspec.title hold the producing run's "
            "time, so the files differ from run to run.",
            "Oracle: safetensors.torch.load_file(path) (sd-scripts' LoRANetwork.load_weights reads the file "
            "so and load_state_dict(strict=False)): the same tensors, fp16.",
        ]
    if kind == "litgpt":
        return [
            "The real `litgpt pretrain` command (litgpt.__main__.main with sys.argv = " + json.dumps(LITGPT_CLI[:3])
            + " + options, see 'cli'), one CPU process, Fabric strategy 'auto', precision 32-true, "
            "torch.compile'd GPT (Fabric unwraps it when saving: keys have no '_orig_mod.').",
            "--data step_records.RandomTokenData: a litgpt DataModule defined in this script (random tokens, "
            f"{LITGPT_SAMPLES} rows of 17 tokens) whose train loader has a state_dict like litdata's "
            "StreamingDataLoader (litgpt's own pretraining data modules need litdata and a tokenizer): "
            "'train_dataloader' in the file is that dict. hyperparameters.yaml records the class path.",
            "global_batch_size 4, micro_batch_size 2, 1 device -> gradient accumulation 2: state['iter_num'] "
            "counts micro-batches, state['step_count'] optimizer steps; max_tokens 384 -> 12 iterations, 6 steps.",
            "save_interval 2: fit() saves out/step-%08d/lit_model.pth % step_count with model_config.yaml and "
            "hyperparameters.yaml beside it; main() saves once more after the loop to out/final/lit_model.pth "
            "(same weights and counters as step-00000006; its train_dataloader state has one more micro-batch "
            "drawn: the loop pulls a batch before it sees iter_num >= max_iters and stops).",
            "lit_model.pth holds {'model', 'optimizer', 'train_dataloader', 'iter_num', 'step_count'} "
            "(Fabric turns module/optimizer/stateful loader into their state dicts).",
            "Oracle: litgpt.utils.load_checkpoint(fabric, GPT(Config.from_file(model_config.yaml)), path) -> "
            "model.state_dict().",
            *removed_note,
        ]
    if kind == "litgpt_iter":
        return [
            "A loop written for this fixture in the style of lit-gpt's pretrain/openwebtext.py (late 2023): "
            "module-level settings saved as 'hparams' (ints/floats/strings), L.Fabric(devices=1, "
            "precision='32-true'), GPT from litgpt 0.5.13 (lit_gpt's module names then were the same but "
            "'attn.attn' for today's 'attn.qkv'), AdamW(foreach=False), random-token IterableDataset "
            "(in memory; the script memmaps data/<name>/train.bin), no logger, no validation.",
            "The loop is `for state['iter_num'] in range(state['iter_num'], max_iters)`: state['iter_num'] is the "
            "0-based index of the micro-batch being processed, and a local iter_num = state['iter_num'] + 1 "
            "names the file. So out/openwebtext/iter-000008-ckpt.pth (8 micro-batches done) holds iter_num 7 "
            "and step_count 4. Gradient accumulation 2, save_interval 2 optimizer steps, max_iters 12.",
            "fabric.save(out_dir / f'iter-{iter_num:06d}-ckpt.pth', state) with state = {'model', 'optimizer', "
            "'hparams', 'iter_num', 'step_count'}.",
            "Oracle: GPT(Config(**model config)).load_state_dict(lazy_load(path)['model'], strict=True) "
            "(litgpt.utils.load_checkpoint) -> state_dict().",
        ]
    if kind == "composer":
        return [
            COMPOSER_STUB_NOTE,
            "composer.Trainer(model=ComposerClassifier(TinyClassifierNet(), num_classes=3), AdamW, "
            "max_duration='6ba', save_folder='checkpoints', save_interval='2ba', device='cpu', "
            "device_train_microbatch_size=2 (batches of 4 -> 2 micro-batches per optimizer step), "
            f"run_name='tiny-composer', seed={SEED}); {COMPOSER_SAMPLES} samples -> 4 batches per epoch.",
            "Composer's default names: ep{epoch}-ba{batch}-rank{rank}.pt, and latest-rank0.pt, a relative "
            "symlink re-pointed at each save (kept as a symlink).",
            "state.timestamp is {'Timestamp': Timestamp.state_dict()}: batch = optimizer steps (batches, not "
            "micro-batches), epoch, sample, token (0: the dataloader reports no tokens), *_in_epoch, "
            "iteration, *_in_iteration, and total/iteration/epoch/batch wall-clock times as datetime.timedelta.",
            "ComposerClassifier keeps the network as self.module, so state.model keys start with 'module.' and "
            "the oracle keeps them (Composer loads state.model.load_state_dict(state['state']['model'])).",
            "The CheckpointSaver callback state lists every saved path (relative here: the save folder was "
            "relative) with its timestamp; metadata records the Composer env (cpu model, counts).",
        ]
    if kind == "olmo":
        return [
            "The real OLMo-core Trainer in one CPU process (no process group): TransformerConfig.llama_like("
            f"d_model=8, vocab_size={OLMO_VOCAB}, n_layers=1, n_heads=2), TransformerTrainModule "
            "(AdamWConfig lr 1e-2, max_grad_norm 1.0; rank_microbatch_size 32 tokens = 2 instances of "
            f"{OLMO_SEQ}), NumpyFSLDataset over a random uint16 token file, global batch 64 tokens = 4 "
            "instances -> 2 micro-batches per optimizer step, Duration.steps(6).",
            "CheckpointerCallback(save_interval=2, pre_train_checkpoint=False, save_async=False): Checkpointer.save "
            "writes ckpts/step{N}-tmp/ and renames it to ckpts/step{N}/: train/rank0.pt (torch.save of "
            "Trainer.state_dict(): global_step, global_train_tokens_seen, data_loader state, epoch, rng, "
            "callbacks), model_and_optim/ (DCP through OLMo-core's RemoteFileSystemWriter, whose .metadata "
            "storage_data values are olmo_core.distributed.checkpoint.filesystem._StorageInfo), then "
            ".metadata.json ({'ephemeral': false, 'version': '3.0.0'}); ConfigSaverCallback writes config.json "
            "and data_paths.txt into each step folder.",
            "The DCP state dict is TransformerTrainModule.state_dict_to_save(): {'model': ..., 'optim': ...} with "
            "flatten_optimizer_state_dict=True (OLMo-core's default): keys 'model.<fqn>', "
            "'optim.state.<fqn>.{step,exp_avg,exp_avg_sq}' and 'optim.param_groups.<fqn>.<option>' per parameter. "
            "The thread pool writes several __0_<i>.distcp files per rank.",
            "The .metadata storage_meta.checkpoint_id names the temporary folder (ckpts/step{N}-tmp/"
            "model_and_optim, relative: the save folder was relative).",
            "data_paths.txt names data/tokens.npy, the random token file, removed after training. "
            "OLMo-core counts epochs from 1 (train/rank0.pt epoch and data_loader.epoch are 1 in the first pass).",
            "torch 2.13's own FileSystemReader cannot read these folders (so neither can dcp.load without "
            "OLMo-core's reader, nor format_utils.dcp_to_torch_save): its read_data asks every storage_data "
            "value for .transform_descriptors, which OLMo-core 3.0.0's _StorageInfo (relative_path, offset, "
            "length) lacks -> AttributeError. OLMo-core's RemoteFileSystemReader reads them.",
            "Oracle: load_model_and_optim_state(ckpts/stepN/model_and_optim, model) into a fresh model "
            "(OLMo-core's own loader, 1 process) -> model.state_dict() (keys without 'model.').",
            *removed_note,
        ]
    if kind == "mmengine":
        return [
            "The real mmengine Runner.from_cfg(Config(...)), launcher 'none', CPU (no CUDA), TinyMMNet (a "
            "BaseModel registered in MODELS: Linear, BatchNorm1d, ReLU, Linear) and TinyMMDataset (12 random "
            "samples, registered in DATASETS), batch 4 -> 3 iterations per epoch, AdamW lr 1e-2, "
            "train_cfg by_epoch max_epochs 3, CheckpointHook(interval=1), experiment_name 'tiny'.",
            "Two runs in one set: work_dir/ (no EMA) and ema_hook/work_dir/ (custom_hooks=[EMAHook("
            f"momentum={MM_EMA_MOMENTUM})], ExponentialMovingAverage: ema = (1 - m) * ema + m * param).",
            "Kept beside the checkpoints: <timestamp>.py, the config Runner.dump_config writes into work_dir "
            "(named after the run's timestamp: there is no config file).",
            "CheckpointHook writes epoch_{E}.pth after each epoch and a 'last_checkpoint' text file holding the "
            "newest file's ABSOLUTE path (Runner makes work_dir absolute); message_hub.runtime_info.last_ckpt "
            "is absolute too. Both name the producing machine's folders.",
            "Each .pth: {'meta': {epoch, iter, cfg (pretty text), seed, experiment_name, time, mmengine_version, "
            "...}, 'state_dict', 'message_hub', 'optimizer'} (+ 'ema_state_dict'). meta.iter = iterations = "
            "optimizer steps (no accumulation); meta.epoch = epochs done. message_hub.runtime_info's epoch and "
            "iter are one behind (updated before the epoch/iteration counters are advanced).",
            "With EMAHook, before_save_checkpoint SWAPS: 'state_dict' holds the EMA weights and "
            "'ema_state_dict' the raw training weights under 'module.' (plus 'steps', the EMA update count), "
            "so load_checkpoint gives deployment the EMA; Runner.resume swaps back. oracle = what "
            "load_checkpoint gives (the EMA); oracle_training = the training weights.",
            "mmengine 0.10.7 calls torch.load(filename, map_location) without weights_only; torch >= 2.6 "
            "then refuses the file (message_hub pickles mmengine.logging.history_buffer.HistoryBuffer and "
            "numpy arrays). The oracles are taken with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (torch's documented "
            "override), the only load-side change.",
            *removed_note,
        ]
    return [
        "pytorch_lightning.Trainer(accelerator='cpu', devices=1, max_epochs=2), TinyGAN(LightningModule) with "
        "self.generator and self.discriminator, automatic_optimization=False, configure_optimizers -> "
        "[AdamW(generator), AdamW(discriminator)]; each training_step: generator step, then discriminator step "
        f"({GAN_SAMPLES} samples, batch {GAN_BATCH} -> 2 batches per epoch, 4 batches). No CPU patch.",
        "Under manual optimization Lightning's global_step counts every optimizer.step() of every optimizer "
        "(loops ... manual_optimization.optim_step_progress), so it is 2 x batches: after "
        f"{record.get('batches_total')} batches global_step is {record.get('global_step_total')}.",
        "ModelCheckpoint(dirpath='ckpts', every_n_train_steps=2, save_top_k=-1) checks global_step % 2 after each "
        "batch: with global_step advancing by 2 per batch it saves after EVERY batch: epoch=E-step=N.ckpt, "
        "N = global_step (2, 4, 6, 8) while each AdamW's step (and the batch count) is N / 2.",
        "optimizer_step in this file is the number of updates each parameter received (batches): the "
        "generator's and the discriminator's AdamW 'step'.",
        "Saved from on_train_batch_end: the loop state in the file counts the current batch as 'processed' "
        "but not yet 'completed' (completed = batches - 1); epoch_loop.state_dict._batches_that_stepped "
        "(the logger's step) lags the same way.",
        "The callback state records the absolute dirpath of the producing machine (Lightning resolves it).",
        "Oracle keys are the LightningModule's ('generator.0.weight', 'discriminator.0.weight', ...).",
    ]


def launch(set_name: str, set_dir: Path, *, worker: str, timeout: float = 600) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    cmd = [sys.executable, str(THIS), "--worker", worker, "--set", set_name, "--set-dir", str(set_dir)]
    run_worker(cmd, env=env, cwd=set_dir, label=f"{set_name}/{worker}", timeout=timeout)


def produce(set_name: str, out: Path) -> Path:
    kind = SETS[set_name]["kind"]
    set_dir = fresh_set_dir(out, set_name)
    t0 = time.time()
    launch(set_name, set_dir, worker=kind)
    record_path = set_dir / WORKER_RECORD
    record = json.loads(record_path.read_text())
    record_path.unlink()
    checkpoints = record["checkpoints"]
    if sum(1 for e in checkpoints.values() if "optimizer_step" in e) < 3:
        raise RuntimeError(f"{set_name}: fewer than 3 checkpoints: {sorted(checkpoints)}")
    producer = {
        "set": set_name,
        **set_framework(kind),
        "versions": record.get("versions") or package_versions([]),
        "command": f"python {SCRIPT_REL} --out tests/fixtures/trainers --set {set_name}",
        "cwd": "the set folder (relative output folders)",
        "world_size": 1,
        "seed": SEED,
        "env": {"OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "CUDA_VISIBLE_DEVICES": ""},
        "checkpoints": checkpoints,
        "notes": set_notes(set_name, kind, record),
        "cpu_patches": cpu_patches(kind),
    }
    if kind == "litgpt":
        producer["cli"] = LITGPT_CLI
        producer["model_config"] = LITGPT_MODEL_CONFIG
    if kind == "litgpt_iter":
        producer["hparams"] = LIT_ITER_SETTINGS
        producer["model_config"] = LITGPT_MODEL_CONFIG
    if kind == "kohya":
        producer["args"] = KOHYA_ARGS
    if kind == "mmengine":
        producer["runs"] = record.get("runs")
    (set_dir / "producer.json").write_text(json.dumps(producer, indent=2, default=str) + "\n")
    size = sum(p.stat().st_size for p in set_dir.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"[{set_name}] {len(checkpoints)} entries, {size / 1024:.0f} KiB, {time.time() - t0:.0f} s", flush=True)
    return set_dir


def cpu_patches(kind: str) -> list[str]:
    if kind == "composer":
        return ["torchvision replaced by stub modules (see notes); no Composer code changed"]
    if kind == "mmengine":
        return ["loading only: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 for mmengine's own torch.load (torch >= 2.6)"]
    return []


WORKERS = {
    "kohya": kohya_worker,
    "litgpt": litgpt_worker,
    "litgpt_iter": litgpt_iter_worker,
    "composer": composer_worker,
    "olmo": olmo_worker,
    "mmengine": mmengine_worker,
    "lightning_gan": lightning_gan_worker,
}


def main(argv: list[str] | None = None) -> int:
    return run_producer(__doc__.splitlines()[0], SETS, WORKERS, produce, argv)


if __name__ == "__main__":
    sys.exit(main())
