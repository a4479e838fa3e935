"""Produce single-file training checkpoints as test fixtures: Lightning ``ModelCheckpoint`` (one
device and DDP), an MAE/DeiT-style ``save_model`` loop, a nanoGPT-style loop (``torch.compile``
keys) and timm's own ``CheckpointSaver`` with ``ModelEmaV3``, each beside an ``oracle/`` folder
holding the model weights of every file as the framework's own loading code reads them.

Run from the repository root with the producers' virtualenv (torch CPU, pytorch-lightning,
timm installed without its torchvision dependency, safetensors)::

    .venv-fixtures/bin/python tests/producers/trainers/single_files.py \\
        --out tests/fixtures/trainers --set all

``--set`` takes ``all`` or a comma-separated list of: lightning-single, lightning-ddp,
research-mae, nanogpt, timm-saver. Each set is written into ``OUT/<set>/`` (deleted first;
nothing else is touched). Training runs in a child process (``--worker``): a plain Python
process for one-rank sets, ``torch.distributed.run`` (gloo, a free TCP port) for
``lightning-ddp``; ``OMP_NUM_THREADS=1`` everywhere. The research-style loops run with the set
folder as their working directory and relative output folders (``./output_dir``, ``out``,
``output/...``), so no absolute path of the producing machine lands in those files. Each set
holds:

* the checkpoint files exactly as written by the saving code (symlinks kept as symlinks);
* ``oracle/<file name>.safetensors``: the model state dict as the framework's own loading code
  gets it from that file (tensors cloned and contiguous; tied weights become two tensors);
  timm also ``oracle/<file name>.ema.safetensors`` (``load_state_dict(use_ema=True)``);
* ``producer.json``: set, versions, command, world size, ``checkpoints`` (per file:
  ``optimizer_step``, ``epoch``, ``oracle``, ``top_level_keys``, ``globals`` (pickle GLOBALs
  other than torch's tensor/storage rebuilders), ``unsafe_globals`` (those outside
  ``torch.load(weights_only=True)``'s allowlist), ``weights_only_loads``, and ``copy_of`` /
  ``symlink_to`` for alias files), ``notes`` (every stub and choice), ``module_class_source``
  and ``module_factory`` (rebuild the model and ``load_state_dict(oracle, strict=True)``).

Nothing patches any saving code. timm is imported without torchvision: its parent packages
(``timm``, ``timm.utils``, ``timm.models``) are stubbed so that their ``__init__`` files (which
pull in timm.data -> torchvision) do not run, and ``torchvision.ops.misc.FrozenBatchNorm2d`` is
a placeholder class (``timm.utils.model`` and ``timm.layers`` import the name; nothing here
uses it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import textwrap
import time
import types
import zipfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_common import (
    RETRY_MARKERS,
    free_port,
    fresh_set_dir,
    optimizer_step_of,
    package_versions,
    run_producer,
    run_worker,
    torch_file_facts,
    write_oracle,
)
from fixture_common import TORCHRUN_VARS as _TORCHRUN_VARS

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

THIS = Path(__file__).resolve()
SCRIPT_REL = "tests/producers/trainers/single_files.py"
SEED = 1234
WORKER_RECORD = "_worker.json"  # what the training loop knew at each save; read and removed

SETS: dict[str, dict] = {
    "lightning-single": {"nproc": 1, "kind": "lightning", "save_last": True},
    "lightning-ddp": {"nproc": 2, "kind": "lightning", "save_last": "link"},
    "research-mae": {"nproc": 1, "kind": "mae"},
    "nanogpt": {"nproc": 1, "kind": "nanogpt"},
    "timm-saver": {"nproc": 1, "kind": "timm"},
}

# ---------------------------------------------------------------------------------------------
# Lightning (ModelCheckpoint every 2 optimizer steps, save_last)
# ---------------------------------------------------------------------------------------------

LIGHTNING_MAX_STEPS = 8
LIGHTNING_SAMPLES = 24
LIGHTNING_GLOBAL_BATCH = 8  # -> 3 optimizer steps per epoch on 1 rank (batch 8) and 2 ranks (4 each)
LIGHTNING_HPARAMS = {"lr": 2e-2, "hidden": 10, "tags": ["tiny", "single-file"]}

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the producers' venv has it
    pl = None  # type: ignore[assignment]

if pl is not None:

    class TinyHparamsLitModule(pl.LightningModule):
        """A small MLP held as ``self.model``, with ``save_hyperparameters()`` of its init args."""

        def __init__(self, lr: float = 2e-2, hidden: int = 10, tags: list | None = None) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = nn.Sequential(nn.Linear(6, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


LIGHTNING_SOURCE_HEADER = (
    "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\nimport pytorch_lightning as pl\n\n"
)


def lightning_worker(set_name: str, set_dir: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    spec = SETS[set_name]
    pl.seed_everything(SEED, workers=True)
    g = torch.Generator().manual_seed(SEED)
    data = TensorDataset(torch.randn(LIGHTNING_SAMPLES, 6, generator=g), torch.randn(LIGHTNING_SAMPLES, 3, generator=g))
    loader = DataLoader(data, batch_size=LIGHTNING_GLOBAL_BATCH // spec["nproc"], shuffle=False)
    module = TinyHparamsLitModule(**LIGHTNING_HPARAMS)
    callback = ModelCheckpoint(
        dirpath=set_dir / "ckpts", every_n_train_steps=2, save_top_k=-1, save_last=spec["save_last"]
    )
    with tempfile.TemporaryDirectory(prefix="lightning-root-") as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=spec["nproc"],
            num_nodes=1,
            strategy="ddp" if spec["nproc"] > 1 else "auto",
            max_steps=LIGHTNING_MAX_STEPS,
            callbacks=[callback],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            deterministic=True,
        )
        trainer.fit(module, loader)
    if trainer.is_global_zero:
        record = {"strategy": type(trainer.strategy).__name__, "global_step": trainer.global_step}
        (set_dir / WORKER_RECORD).write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------
# MAE / DeiT style: argparse args, AdamW with two parameter groups, a loss scaler, and
# util/misc.py save_model's dict every epoch as <output_dir>/checkpoint-<epoch>.pth
# ---------------------------------------------------------------------------------------------


class TinyMAE(nn.Module):
    """A masked-autoencoder-shaped toy: patch embedding, cls and mask tokens, a fixed (frozen)
    position embedding, one pre-norm transformer block and a pixel-prediction head."""

    def __init__(
        self, img_size=8, patch_size=4, in_chans=3, embed_dim=16, num_heads=2, mlp_ratio=2.0, norm_pix_loss=False
    ):
        super().__init__()
        self.patch_size = patch_size
        self.norm_pix_loss = norm_pix_loss
        num_patches = (img_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim), requires_grad=False)
        self.norm1 = nn.LayerNorm(embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(embed_dim)
        hidden = int(embed_dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, hidden), nn.GELU(), nn.Linear(hidden, embed_dim))
        self.norm = nn.LayerNorm(embed_dim)
        self.decoder_pred = nn.Linear(embed_dim, patch_size * patch_size * in_chans)
        with torch.no_grad():  # a fixed sin-cos table over positions (cls token = position 0)
            pos = torch.arange(num_patches + 1, dtype=torch.float32).unsqueeze(1)
            freq = torch.exp(torch.arange(0, embed_dim, 2, dtype=torch.float32) * (-math.log(1e4) / embed_dim))
            self.pos_embed[0, :, 0::2] = torch.sin(pos * freq)
            self.pos_embed[0, :, 1::2] = torch.cos(pos * freq)
            nn.init.normal_(self.cls_token, std=0.02)
            nn.init.normal_(self.mask_token, std=0.02)

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        b, c, h, w = imgs.shape
        x = imgs.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (h // p) * (w // p), p * p * c)

    def forward(self, imgs: torch.Tensor, mask_ratio: float = 0.5):
        x = self.patch_embed(imgs).flatten(2).transpose(1, 2)
        b, n, _ = x.shape
        keep = int(n * (1 - mask_ratio))
        ranks = torch.rand(b, n, device=x.device).argsort(dim=1).argsort(dim=1)
        mask = (ranks >= keep).to(x.dtype)  # 1 = masked patch
        x = torch.where(mask.unsqueeze(-1).bool(), self.mask_token.to(x.dtype), x) + self.pos_embed[:, 1:]
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(b, -1, -1)
        x = torch.cat([cls.to(x.dtype), x], dim=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        pred = self.decoder_pred(self.norm(x)[:, 1:])
        target = self.patchify(imgs)
        if self.norm_pix_loss:
            mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred.float() - target) ** 2).mean(dim=-1)
        return (loss * mask).sum() / mask.sum(), pred, mask


MAE_SOURCE_HEADER = "import math\n\nimport torch\nimport torch.nn as nn\n\n"
MAE_CLI = ["--epochs", "4", "--batch_size", "4", "--accum_iter", "2", "--blr", "0.5", "--norm_pix_loss",
           "--seed", str(SEED), "--output_dir", "./output_dir"]  # fmt: skip
MAE_ITERS_PER_EPOCH = 6  # 6 batches, accum_iter 2 -> 3 optimizer steps per epoch


def mae_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser("tiny MAE-style pre-training", add_help=False)
    parser.add_argument("--batch_size", default=64, type=int, help="batch size per process")
    parser.add_argument("--epochs", default=400, type=int)
    parser.add_argument("--accum_iter", default=1, type=int, help="gradient accumulation iterations")
    parser.add_argument("--model", default="tiny_mae_patch4", type=str)
    parser.add_argument("--input_size", default=8, type=int)
    parser.add_argument("--mask_ratio", default=0.5, type=float)
    parser.add_argument("--norm_pix_loss", action="store_true")
    parser.set_defaults(norm_pix_loss=False)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=None, help="absolute lr (default: blr * batch / 256)")
    parser.add_argument("--blr", type=float, default=1e-3, help="base learning rate")
    parser.add_argument("--min_lr", type=float, default=0.0)
    parser.add_argument("--warmup_epochs", type=int, default=1)
    parser.add_argument("--opt_betas", type=float, nargs=2, default=[0.9, 0.95])
    parser.add_argument("--data_path", default="./data", type=str)
    parser.add_argument("--output_dir", default=Path("./output_dir"), type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--resume", default="")
    parser.add_argument("--start_epoch", default=0, type=int)
    parser.add_argument("--num_workers", default=0, type=int)
    parser.add_argument("--pin_mem", action="store_true")
    parser.add_argument("--world_size", default=1, type=int)
    parser.add_argument("--local_rank", default=-1, type=int)
    parser.add_argument("--dist_url", default="env://")
    return parser


class LossScalerWithGradNorm:
    """The loss-scaler wrapper such loops keep beside the optimizer: scale, backward, and on an
    update iteration unscale, clip and step; its state dict is the GradScaler's."""

    state_dict_key = "amp_scaler"

    def __init__(self, device: str) -> None:
        self._scaler = torch.amp.GradScaler(device)

    def __call__(self, loss, optimizer, parameters, clip_grad=None, update_grad=True):
        self._scaler.scale(loss).backward()
        if not update_grad:
            return None
        self._scaler.unscale_(optimizer)
        params = [p for p in parameters if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad is not None else float("inf"))
        self._scaler.step(optimizer)
        self._scaler.update()
        return norm

    def state_dict(self):
        return self._scaler.state_dict()


def mae_lr_at(args, epoch_float: float) -> float:
    """Linear warmup, then a half cosine down to min_lr (per iteration, as MAE's loop does)."""
    if epoch_float < args.warmup_epochs:
        return args.lr * epoch_float / args.warmup_epochs
    progress = (epoch_float - args.warmup_epochs) / (args.epochs - args.warmup_epochs)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def mae_save_model(args, epoch, model, model_without_ddp, optimizer, loss_scaler) -> Path:
    """What MAE/DeiT's util/misc.py save_model puts into checkpoint-<epoch>.pth (rank 0 saves)."""
    path = Path(args.output_dir) / f"checkpoint-{epoch}.pth"
    to_save = {
        "model": model_without_ddp.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "scaler": loss_scaler.state_dict(),
        "args": args,
    }
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(to_save, path)
    return path


def mae_worker(set_name: str, set_dir: Path) -> None:
    args = mae_args_parser().parse_args(MAE_CLI)
    torch.manual_seed(args.seed)
    args.distributed = False
    eff_batch_size = args.batch_size * args.accum_iter * args.world_size
    if args.lr is None:
        args.lr = args.blr * eff_batch_size / 256
    args.output_dir.mkdir(parents=True, exist_ok=True)

    g = torch.Generator().manual_seed(args.seed + 1)
    images = torch.randn(MAE_ITERS_PER_EPOCH * args.batch_size, 3, args.input_size, args.input_size, generator=g)
    model = TinyMAE(img_size=args.input_size, norm_pix_loss=args.norm_pix_loss)
    model_without_ddp = model
    decay, no_decay = [], []
    for name, param in model_without_ddp.named_parameters():
        if not param.requires_grad:
            continue  # the frozen position table
        (no_decay if param.ndim <= 1 or name.endswith(".bias") or name.endswith("_token") else decay).append(param)
    param_groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": args.weight_decay}]
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, betas=tuple(args.opt_betas))
    loss_scaler = LossScalerWithGradNorm(args.device)
    autocast = torch.autocast(device_type="cpu", dtype=torch.float16)

    record: dict[str, dict] = {}
    optimizer_steps = 0
    for epoch in range(args.start_epoch, args.epochs):
        model.train()
        optimizer.zero_grad()
        for it in range(MAE_ITERS_PER_EPOCH):
            if it % args.accum_iter == 0:
                lr = mae_lr_at(args, it / MAE_ITERS_PER_EPOCH + epoch)
                for group in optimizer.param_groups:
                    group["lr"] = lr
            batch = images[it * args.batch_size : (it + 1) * args.batch_size]
            with autocast:
                loss, _, _ = model(batch, mask_ratio=args.mask_ratio)
            update = (it + 1) % args.accum_iter == 0
            scale_before = loss_scaler._scaler.get_scale()
            loss_scaler(loss / args.accum_iter, optimizer, parameters=model.parameters(), update_grad=update)
            if update:
                # GradScaler skips the step when it finds inf/nan gradients (then the scale drops)
                optimizer_steps += int(loss_scaler._scaler.get_scale() >= scale_before)
                optimizer.zero_grad()
        path = mae_save_model(args, epoch, model, model_without_ddp, optimizer, loss_scaler)
        record[path.name] = {
            "epoch": epoch,
            "optimizer_steps_counted": optimizer_steps,
            "iterations": (epoch + 1) * MAE_ITERS_PER_EPOCH,
        }
    (set_dir / WORKER_RECORD).write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------
# nanoGPT style: a GPT with tied embeddings, torch.compile, and the train.py checkpoint dict
# ---------------------------------------------------------------------------------------------


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.dropout = config.dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True


class GPT(nn.Module):
    """A GPT with nanoGPT's module names; the token embedding is tied to the output head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        params = [p for p in self.parameters() if p.requires_grad]  # shared weights listed once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)


NANOGPT_SOURCE_HEADER = (
    "import math\nfrom dataclasses import dataclass\n\nimport torch\nimport torch.nn as nn\n"
    "from torch.nn import functional as F\n\n"
)
# The training script's module-level settings; `config` in the checkpoint is this dict.
NANOGPT_CONFIG = {
    "out_dir": "out",
    "eval_interval": 2,
    "log_interval": 1,
    "eval_iters": 3,
    "eval_only": False,
    "always_save_checkpoint": True,
    "init_from": "scratch",
    "wandb_log": False,
    "dataset": "random_tokens",
    "gradient_accumulation_steps": 2,
    "batch_size": 4,
    "block_size": 16,
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 16,
    "dropout": 0.0,
    "bias": True,
    "learning_rate": 1e-2,
    "max_iters": 8,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "decay_lr": True,
    "warmup_iters": 2,
    "lr_decay_iters": 8,
    "min_lr": 1e-3,
    "backend": "gloo",
    "device": "cpu",
    "dtype": "float32",
    "compile": True,
}
NANOGPT_VOCAB = 32


def nanogpt_worker(set_name: str, set_dir: Path) -> None:
    cfg = dict(NANOGPT_CONFIG)
    torch.manual_seed(SEED)
    out_dir = cfg["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    g = torch.Generator().manual_seed(SEED + 1)
    data = {
        "train": torch.randint(0, NANOGPT_VOCAB, (2000,), generator=g),
        "val": torch.randint(0, NANOGPT_VOCAB, (400,), generator=g),
    }

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - cfg["block_size"], (cfg["batch_size"],), generator=g)
        x = torch.stack([d[i : i + cfg["block_size"]] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + cfg["block_size"]] for i in ix])
        return x, y

    model_args = dict(
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        n_embd=cfg["n_embd"],
        block_size=cfg["block_size"],
        bias=cfg["bias"],
        vocab_size=NANOGPT_VOCAB,
        dropout=cfg["dropout"],
    )
    model = GPT(GPTConfig(**model_args))
    scaler = torch.amp.GradScaler("cpu", enabled=(cfg["dtype"] == "float16"))
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]))
    ctx = nullcontext()  # device_type 'cpu': no autocast
    compile_s = None
    if cfg["compile"]:
        t0 = time.time()
        model = torch.compile(model)
    raw_model = model  # no DDP wrapper on one process

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(cfg["eval_iters"])
            for k in range(cfg["eval_iters"]):
                x, y = get_batch(split)
                with ctx:
                    _, loss = model(x, y)
                losses[k] = loss.item()
            out[split] = losses.mean()
        model.train()
        return out

    def get_lr(it):
        if it < cfg["warmup_iters"]:
            return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
        if it > cfg["lr_decay_iters"]:
            return cfg["min_lr"]
        ratio = (it - cfg["warmup_iters"]) / (cfg["lr_decay_iters"] - cfg["warmup_iters"])
        return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])

    record: dict[str, dict] = {}
    x, y = get_batch("train")
    iter_num = 0
    best_val_loss = 1e9
    while True:
        lr = get_lr(iter_num) if cfg["decay_lr"] else cfg["learning_rate"]
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % cfg["eval_interval"] == 0:
            losses = estimate_loss()
            if losses["val"] < best_val_loss or cfg["always_save_checkpoint"]:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    checkpoint = {
                        "model": raw_model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "model_args": model_args,
                        "iter_num": iter_num,
                        "best_val_loss": best_val_loss,
                        "config": cfg,
                    }
                    name = f"ckpt_{iter_num:06d}.pt"
                    torch.save(checkpoint, os.path.join(out_dir, name))
                    record[f"{out_dir}/{name}"] = {"iter_num": iter_num, "val_loss": float(best_val_loss)}
        for _ in range(cfg["gradient_accumulation_steps"]):
            with ctx:
                _, loss = model(x, y)
                loss = loss / cfg["gradient_accumulation_steps"]
            x, y = get_batch("train")
            scaler.scale(loss).backward()
        if cfg["grad_clip"] != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if compile_s is None and cfg["compile"]:
            compile_s = round(time.time() - t0, 1)
        iter_num += 1
        if iter_num > cfg["max_iters"]:
            break
    record["_meta"] = {"compiled": type(model).__name__, "first_train_iter_incl_compile_s": compile_s}
    (set_dir / WORKER_RECORD).write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------
# timm: CheckpointSaver + ModelEmaV3 as timm's train.py drives them
# ---------------------------------------------------------------------------------------------


class TinyConvNet(nn.Module):
    """Conv stem + BatchNorm (buffers: running_mean/var, num_batches_tracked) + pooled classifier."""

    def __init__(self, in_chans=3, width=8, num_classes=5):
        super().__init__()
        self.conv_stem = nn.Conv2d(in_chans, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.act1 = nn.ReLU(inplace=True)
        self.global_pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.act1(self.bn1(self.conv_stem(x)))
        return self.classifier(self.global_pool(x).flatten(1))


TIMM_SOURCE_HEADER = "import torch\nimport torch.nn as nn\n\n"
TIMM_CLI = ["--model", "tiny_convnet", "--epochs", "5", "-b", "8", "--lr", "0.05", "--weight-decay", "0.05",
            "--model-ema", "--model-ema-decay", "0.8", "--checkpoint-hist", "2", "--eval-metric", "loss",
            "--output", "output", "--experiment", "tiny", "--seed", str(SEED)]  # fmt: skip
TIMM_BATCHES_PER_EPOCH = 4
# The eval metric handed to saver.save_checkpoint each epoch (a loss: decreasing=True). A fixed
# sequence standing in for validate()'s loss, so the saver's retention is exercised predictably:
# epoch 1 is best, epoch 2 evicts epoch 0, epoch 3 evicts epoch 2, epoch 4 earns no place.
TIMM_EVAL_METRICS = (1.0, 0.6, 0.8, 0.7, 0.9)


def timm_args_parser() -> argparse.ArgumentParser:
    """A subset of timm train.py's arguments, under the same names."""
    parser = argparse.ArgumentParser(description="tiny timm-style training")
    parser.add_argument("--model", default="resnet50", type=str)
    parser.add_argument("--num-classes", type=int, default=5)
    parser.add_argument("--input-size", default=[3, 8, 8], nargs=3, type=int)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("-b", "--batch-size", type=int, default=128)
    parser.add_argument("--opt", default="adamw", type=str)
    parser.add_argument("--opt-eps", default=None, type=float)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--weight-decay", type=float, default=2e-5)
    parser.add_argument("--sched", type=str, default="none")
    parser.add_argument("--model-ema", action="store_true", default=False)
    parser.add_argument("--model-ema-force-cpu", action="store_true", default=False)
    parser.add_argument("--model-ema-decay", type=float, default=0.9998)
    parser.add_argument("--model-ema-warmup", action="store_true")
    parser.add_argument("--checkpoint-hist", type=int, default=10)
    parser.add_argument("--eval-metric", default="top1", type=str)
    parser.add_argument("--output", default="", type=str)
    parser.add_argument("--experiment", default="", type=str)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--amp", action="store_true", default=False)
    parser.add_argument("--resume", default="", type=str)
    return parser


TORCHVISION_STUB_NOTE = (
    "timm without torchvision: sys.modules gets stub packages 'torchvision', 'torchvision.ops', "
    "'torchvision.ops.misc' whose only name is FrozenBatchNorm2d, a placeholder nn.Module subclass "
    "(timm.utils.model and timm.layers import it at import time; nothing here calls it). The parent "
    "packages 'timm', 'timm.utils', 'timm.models' are empty stub packages pointing at timm's real "
    "folders, so only the real modules timm.utils.checkpoint_saver, timm.utils.model, "
    "timm.utils.model_ema, timm.layers (imported by timm.utils.model) and timm.models._helpers are "
    "loaded; their code is unchanged. The same stubs are used in the oracle process."
)


def import_timm_pieces() -> types.SimpleNamespace:
    """timm's CheckpointSaver, ModelEmaV3 and models._helpers.load_state_dict, without torchvision."""
    if "timm.utils.checkpoint_saver" not in sys.modules:
        spec = importlib.util.find_spec("timm")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("timm is not installed (pip install --no-deps timm==1.0.31)")
        root = next(iter(spec.submodule_search_locations))
        if importlib.util.find_spec("torchvision") is None:
            for name in ("torchvision", "torchvision.ops", "torchvision.ops.misc"):
                stub = types.ModuleType(name)
                stub.__path__ = []
                sys.modules[name] = stub

            class FrozenBatchNorm2d(nn.Module):
                """Placeholder for torchvision.ops.misc.FrozenBatchNorm2d (never instantiated here)."""

            sys.modules["torchvision.ops.misc"].FrozenBatchNorm2d = FrozenBatchNorm2d
        for name, sub in (("timm", ""), ("timm.utils", "utils"), ("timm.models", "models")):
            if name not in sys.modules:
                pkg = types.ModuleType(name)
                pkg.__path__ = [os.path.join(root, sub) if sub else root]
                sys.modules[name] = pkg
    return types.SimpleNamespace(
        CheckpointSaver=importlib.import_module("timm.utils.checkpoint_saver").CheckpointSaver,
        ModelEmaV3=importlib.import_module("timm.utils.model_ema").ModelEmaV3,
        load_state_dict=importlib.import_module("timm.models._helpers").load_state_dict,
    )


def timm_worker(set_name: str, set_dir: Path) -> None:
    timm = import_timm_pieces()
    args = timm_args_parser().parse_args(TIMM_CLI)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    n = TIMM_BATCHES_PER_EPOCH * args.batch_size
    images = torch.randn(n, *args.input_size, generator=g)
    targets = torch.randint(0, args.num_classes, (n,), generator=g)

    model = TinyConvNet(in_chans=args.input_size[0], num_classes=args.num_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model_ema = timm.ModelEmaV3(
        model,
        decay=args.model_ema_decay,
        use_warmup=args.model_ema_warmup,
        device="cpu" if args.model_ema_force_cpu else None,
    )
    output_dir = os.path.join(args.output, args.experiment)  # timm.utils.get_outdir(args.output, exp_name)
    os.makedirs(output_dir, exist_ok=True)
    decreasing_metric = args.eval_metric == "loss"
    saver = timm.CheckpointSaver(
        model=model,
        optimizer=optimizer,
        args=args,
        model_ema=model_ema,
        amp_scaler=None,
        checkpoint_dir=output_dir,
        recovery_dir=output_dir,
        decreasing=decreasing_metric,
        max_history=args.checkpoint_hist,
    )
    record: dict[str, object] = {"saves": []}
    num_updates = 0
    for epoch in range(args.epochs):
        model.train()
        for i in range(TIMM_BATCHES_PER_EPOCH):
            x = images[i * args.batch_size : (i + 1) * args.batch_size]
            y = targets[i * args.batch_size : (i + 1) * args.batch_size]
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            num_updates += 1
            model_ema.update(model, step=num_updates)
        metric = TIMM_EVAL_METRICS[epoch]
        before = sorted(os.listdir(output_dir))
        best_metric, best_epoch = saver.save_checkpoint(epoch, metric=metric)
        record["saves"].append(
            {
                "epoch": epoch,
                "optimizer_step": num_updates,
                "metric": metric,
                "files_before": before,
                "files_after": sorted(os.listdir(output_dir)),
                "best": [best_metric, best_epoch],
            }
        )
    inodes: dict[int, list[str]] = {}
    for name in sorted(os.listdir(output_dir)):
        inodes.setdefault(os.stat(os.path.join(output_dir, name)).st_ino, []).append(name)
    record["hardlinked_groups"] = [names for names in inodes.values() if len(names) > 1]
    (set_dir / WORKER_RECORD).write_text(json.dumps(record))


# ---------------------------------------------------------------------------------------------
# Oracles, file facts and producer.json (parent process)
# ---------------------------------------------------------------------------------------------

TENSOR_GLOBALS = {"torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter"}


def pickle_globals(path: Path) -> list[str]:
    """Every GLOBAL in the file's data.pkl (torch.save uses protocol 2, so GLOBAL opcodes), minus
    torch's tensor/parameter rebuilders and storage classes."""
    import pickletools

    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            raise RuntimeError(f"{path}: expected one data.pkl record, found {names}")
        data = zf.read(names[0])
    found: set[str] = set()
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:  # not used by protocol 2; best effort
            found.add(f"{strings[-2]}.{strings[-1]}")
    return sorted(g for g in found if g not in TENSOR_GLOBALS and not g.endswith("Storage"))


def zip_archive_name(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        return zf.namelist()[0].split("/")[0]


def file_facts(path: Path) -> dict:
    """``torch_file_facts`` with the file's pickled globals and zip record name, in the fixtures' key order."""
    facts = torch_file_facts(path)
    return {
        "top_level_keys": facts["top_level_keys"],
        "globals": pickle_globals(path),
        "unsafe_globals": facts["unsafe_globals"],
        "weights_only_loads": facts["weights_only_loads"],
        "zip_archive_name": zip_archive_name(path),
        "bytes": facts["bytes"],
    }


def lightning_checkpoints(set_name: str, set_dir: Path) -> dict:
    ckpt_dir = set_dir / "ckpts"
    tool = "torch.load(path, weights_only=False)['state_dict'] (what LightningModule.load_from_checkpoint reads)"
    result = {}
    files = sorted(ckpt_dir.glob("epoch=*-step=*.ckpt"), key=lambda p: int(p.name.split("step=")[1][:-5]))
    for path in files:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        step_in_name = int(path.name.split("step=")[1][:-5])
        epoch_in_name = int(path.name.split("-")[0].split("=")[1])
        if (ckpt["global_step"], ckpt["epoch"]) != (step_in_name, epoch_in_name):
            raise RuntimeError(f"{path}: global_step/epoch {ckpt['global_step']}/{ckpt['epoch']} != name")
        if optimizer_step_of(ckpt["optimizer_states"][0]) != ckpt["global_step"]:
            raise RuntimeError(f"{path}: AdamW step != global_step")
        oracle = f"oracle/{path.name}.safetensors"
        write_oracle(set_dir / oracle, ckpt["state_dict"], tool)
        result[f"ckpts/{path.name}"] = {
            "optimizer_step": ckpt["global_step"],
            "epoch": ckpt["epoch"],
            "name_counts": "optimizer_steps",
            "oracle": oracle,
            **file_facts(path),
        }
    last = ckpt_dir / "last.ckpt"
    newest = files[-1]
    if last.is_symlink():
        target = os.readlink(last)
        if os.path.isabs(target) or (ckpt_dir / target).resolve() != newest.resolve():
            raise RuntimeError(f"{last} -> {target}: not a relative link to {newest.name}")
        entry = dict(result[f"ckpts/{newest.name}"])
        entry["symlink_to"] = target
        result["ckpts/last.ckpt"] = entry
    else:
        ckpt = torch.load(last, map_location="cpu", weights_only=False)
        newest_ckpt = torch.load(newest, map_location="cpu", weights_only=False)
        same = all(torch.equal(ckpt["state_dict"][k], v) for k, v in newest_ckpt["state_dict"].items())
        if not same or ckpt["global_step"] != newest_ckpt["global_step"]:
            raise RuntimeError(f"{last}: not the state of {newest.name}")
        oracle = "oracle/last.ckpt.safetensors"
        write_oracle(set_dir / oracle, ckpt["state_dict"], tool)
        result["ckpts/last.ckpt"] = {
            "optimizer_step": ckpt["global_step"],
            "epoch": ckpt["epoch"],
            "oracle": oracle,
            "copy_of": f"ckpts/{newest.name}",
            "copy_kind": "a second trainer.save_checkpoint at the same step (not a file copy)",
            "byte_identical_to_copy_of": last.read_bytes() == newest.read_bytes(),
            **file_facts(last),
        }
    return result


def mae_checkpoints(set_name: str, set_dir: Path, record: dict) -> dict:
    tool = "torch.load(path, map_location='cpu', weights_only=False)['model'] (MAE/DeiT finetune/resume)"
    result = {}
    files = sorted((set_dir / "output_dir").glob("checkpoint-*.pth"), key=lambda p: int(p.stem.split("-")[1]))
    for path in files:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        step = optimizer_step_of(ckpt["optimizer"])
        if step != record[path.name]["optimizer_steps_counted"] or ckpt["epoch"] != record[path.name]["epoch"]:
            raise RuntimeError(f"{path}: step/epoch {step}/{ckpt['epoch']} != loop's {record[path.name]}")
        oracle = f"oracle/{path.name}.safetensors"
        write_oracle(set_dir / oracle, ckpt["model"], tool)
        result[f"output_dir/{path.name}"] = {
            "optimizer_step": step,
            "epoch": ckpt["epoch"],
            "epochs_completed": ckpt["epoch"] + 1,
            "iterations": record[path.name]["iterations"],
            "name_counts": "epochs",
            "scaler": ckpt["scaler"],
            "oracle": oracle,
            **file_facts(path),
        }
    return result


def nanogpt_checkpoints(set_name: str, set_dir: Path, record: dict) -> dict:
    tool = "nanoGPT sample.py: torch.load(ckpt_path, map_location=device)['model'], '_orig_mod.' prefix stripped"
    result = {}
    for path in sorted((set_dir / "out").glob("ckpt_*.pt")):
        # what nanoGPT's sample.py does (it passes no weights_only, so torch's default applies)
        checkpoint = torch.load(path, map_location="cpu")
        state_dict = checkpoint["model"]
        unwanted_prefix = "_orig_mod."
        for k in list(state_dict):
            if k.startswith(unwanted_prefix):
                state_dict[k[len(unwanted_prefix) :]] = state_dict.pop(k)
        rel = f"out/{path.name}"
        if checkpoint["iter_num"] != record[rel]["iter_num"] or checkpoint["iter_num"] != int(path.stem.split("_")[1]):
            raise RuntimeError(f"{path}: iter_num {checkpoint['iter_num']} != name / loop")
        step = optimizer_step_of(checkpoint["optimizer"])
        if step != checkpoint["iter_num"]:
            raise RuntimeError(f"{path}: AdamW step {step} != iter_num {checkpoint['iter_num']}")
        oracle = f"oracle/{path.name}.safetensors"
        write_oracle(set_dir / oracle, state_dict, tool)
        raw = torch.load(path, map_location="cpu", weights_only=False)["model"]
        tied = (
            raw["_orig_mod.lm_head.weight"].untyped_storage().data_ptr()
            == raw["_orig_mod.transformer.wte.weight"].untyped_storage().data_ptr()
        )
        result[rel] = {
            "optimizer_step": step,
            "iter_num": checkpoint["iter_num"],
            "best_val_loss": float(checkpoint["best_val_loss"]),
            "best_val_loss_type": f"{type(checkpoint['best_val_loss']).__name__} "
            f"shape {list(checkpoint['best_val_loss'].shape)}",
            "name_counts": "optimizer_steps",
            "key_prefix": "_orig_mod." if all(k.startswith("_orig_mod.") for k in raw) else None,
            "tied_storage_in_file": ["_orig_mod.transformer.wte.weight", "_orig_mod.lm_head.weight"] if tied else None,
            "oracle": oracle,
            **file_facts(path),
        }
    return result


def timm_checkpoints(set_name: str, set_dir: Path, record: dict) -> dict:
    timm = import_timm_pieces()
    out = set_dir / "output" / "tiny"
    tool = "timm.models._helpers.load_state_dict(path, use_ema={})"
    saves = {s["epoch"]: s for s in record["saves"]}
    groups = {name: group for group in record["hardlinked_groups"] for name in group}
    names = sorted(p.name for p in out.iterdir())
    result = {}
    for name in names:
        path = out / name
        full = torch.load(path, map_location="cpu", weights_only=False)
        epoch = full["epoch"]
        if optimizer_step_of(full["optimizer"]) != saves[epoch]["optimizer_step"]:
            raise RuntimeError(f"{path}: AdamW step != the loop's")
        oracle = f"oracle/{name}.safetensors"
        oracle_ema = f"oracle/{name}.ema.safetensors"
        write_oracle(set_dir / oracle, timm.load_state_dict(str(path), use_ema=False), tool.format(False))
        write_oracle(set_dir / oracle_ema, timm.load_state_dict(str(path), use_ema=True), tool.format(True))
        entry = {
            "optimizer_step": saves[epoch]["optimizer_step"],
            "epoch": epoch,
            "epochs_completed": epoch + 1,
            "metric": full.get("metric"),
            "name_counts": "epochs" if name.startswith("checkpoint-") else None,
            "oracle": oracle,
            "oracle_ema": oracle_ema,
        }
        twins = [n for n in groups.get(name, []) if n != name and n.startswith("checkpoint-")]
        if not name.startswith("checkpoint-"):
            if twins:
                entry["copy_of"] = f"output/tiny/{twins[0]}"
                entry["copy_kind"] = "a hard link (os.link) of the same file when written; git stores two copies"
            else:
                entry["copy_of"] = None
        if name == "last.pth.tar":
            entry["written_as"] = "tmp.pth.tar, then os.replace -> last.pth.tar"
        if name == "model_best.pth.tar":
            entry["written_as"] = "os.link(last.pth.tar) when the epoch became best"
        if name.startswith("checkpoint-"):
            entry["written_as"] = "os.link(last.pth.tar) right after last.pth.tar was written"
        entry.update(file_facts(path))
        result[f"output/tiny/{name}"] = entry
    return result


def versions(kind: str) -> dict:
    import importlib.metadata as md

    names = {"lightning": ["pytorch-lightning"], "mae": [], "nanogpt": [], "timm": ["timm"]}[kind]
    out = package_versions(names)
    if kind == "lightning":
        import lightning_fabric

        out["lightning_fabric (bundled)"] = lightning_fabric.__version__
        out["fsspec"] = md.version("fsspec")
    return out


def module_source(kind: str) -> str:
    def src(*objs) -> str:
        return "\n\n".join(textwrap.dedent(inspect.getsource(o)) for o in objs)

    if kind == "lightning":
        return LIGHTNING_SOURCE_HEADER + src(TinyHparamsLitModule)
    if kind == "mae":
        return MAE_SOURCE_HEADER + src(TinyMAE)
    if kind == "nanogpt":
        return NANOGPT_SOURCE_HEADER + src(LayerNorm, CausalSelfAttention, MLP, Block, GPTConfig, GPT)
    return TIMM_SOURCE_HEADER + src(TinyConvNet)


def module_factory(kind: str) -> str:
    if kind == "lightning":
        return f"TinyHparamsLitModule(**{LIGHTNING_HPARAMS!r})"
    if kind == "mae":
        return "TinyMAE(img_size=8, norm_pix_loss=True)"
    if kind == "nanogpt":
        c = NANOGPT_CONFIG
        return (
            f"GPT(GPTConfig(n_layer={c['n_layer']}, n_head={c['n_head']}, n_embd={c['n_embd']}, "
            f"block_size={c['block_size']}, bias={c['bias']}, vocab_size={NANOGPT_VOCAB}, "
            f"dropout={c['dropout']}))"
        )
    return "TinyConvNet(in_chans=3, width=8, num_classes=5)"


def verify_strict(set_dir: Path, producer: dict) -> None:
    """Rebuild the module from the recorded source and load every oracle strictly."""
    from safetensors.torch import load_file

    namespace: dict = {"__name__": f"fixture_{producer['set'].replace('-', '_')}"}
    module_name = namespace["__name__"]
    sys.modules[module_name] = types.ModuleType(module_name)  # dataclasses look their module up
    sys.modules[module_name].__dict__.update(namespace)
    exec(compile(producer["module_class_source"], f"<{producer['set']}>", "exec"), sys.modules[module_name].__dict__)
    model = eval(producer["module_factory"], sys.modules[module_name].__dict__)
    for entry in producer["checkpoints"].values():
        for key in ("oracle", "oracle_ema"):
            if key in entry:
                model.load_state_dict(load_file(str(set_dir / entry[key])), strict=True)
    del sys.modules[module_name]


def set_notes(set_name: str, record: dict) -> list[str]:
    spec = SETS[set_name]
    kind = spec["kind"]
    if kind == "lightning":
        notes = [
            "pytorch_lightning.Trainer(accelerator='cpu', devices="
            f"{spec['nproc']}, strategy={'ddp' if spec['nproc'] > 1 else 'auto'!r}) -> "
            f"{record.get('strategy')}; max_steps={LIGHTNING_MAX_STEPS}, {LIGHTNING_SAMPLES} samples, "
            f"global batch {LIGHTNING_GLOBAL_BATCH} -> 3 optimizer steps per epoch (epochs 0, 1, 2). "
            "No CPU patch.",
            "ModelCheckpoint(dirpath=<set>/ckpts, every_n_train_steps=2, save_top_k=-1, save_last="
            f"{spec['save_last']!r}): epoch=E-step=N.ckpt at steps 2, 4, 6, 8 (default name "
            "'{epoch}-{step}'; E is trainer.current_epoch at the save, N = global_step = optimizer steps).",
            "TinyHparamsLitModule calls self.save_hyperparameters(): 'hyper_parameters' is a plain dict "
            f"{LIGHTNING_HPARAMS!r} ('hparams_name': 'kwargs'); OmegaConf is not installed.",
            "Writing: Lightning's _atomic_save torch.saves into a BytesIO, then fsspec's local transaction "
            "writes a tempfile.mkstemp() file in the system temp folder and shutil.moves it onto the name "
            "(an atomic rename when the temp folder is on the same filesystem, else copy + delete).",
            "The callback state inside each file records the absolute dirpath of the machine that "
            "produced the fixtures (and best/last model paths).",
            "Oracle keys are the LightningModule's state_dict keys ('model.0.weight', ...): "
            "TinyHparamsLitModule(**hparams).load_state_dict(oracle, strict=True) works.",
        ]
        if spec["save_last"] == "link":
            notes += [
                "2 CPU ranks under torch.distributed.run (gloo, DDPStrategy); rank 0 writes the files.",
                "save_last='link': after each save ModelCheckpoint._link_checkpoint replaces last.ckpt by "
                "os.symlink(<relative name>, last.ckpt); the fixture keeps it as a relative symlink "
                "(git stores symlinks); its checkpoints entry repeats the target's with 'symlink_to'.",
            ]
        else:
            notes.append(
                "save_last=True: last.ckpt is written by a second trainer.save_checkpoint at the same "
                "step right after epoch=E-step=N.ckpt (not a file copy). The final last.ckpt is "
                "byte-identical to epoch=2-step=8.ckpt: both were serialized into a BytesIO (zip archive "
                "name 'archive') and the callback state in both already names last.ckpt as "
                "last_model_path and epoch=2-step=8.ckpt as best_model_path. (After the first save they "
                "differ: epoch=0-step=2.ckpt has last_model_path ''.) It has its own oracle."
            )
        return notes
    if kind == "mae":
        return [
            "A training loop in the style of MAE/DeiT main_pretrain.py + util/misc.py, written for this "
            "fixture: args from a real argparse.ArgumentParser (" + " ".join(MAE_CLI) + "), "
            "args.lr = blr * batch_size * accum_iter / 256 set after parsing (as MAE does), "
            "args.distributed=False added; --output_dir has type=pathlib.Path, so 'args' pickles a "
            "pathlib.PosixPath.",
            "TinyMAE (a toy masked autoencoder with a frozen pos_embed Parameter, requires_grad=False, "
            "not in the optimizer); AdamW over two parameter groups (no weight decay for 1-d params and "
            "tokens), betas (0.9, 0.95); per-iteration warmup+cosine lr.",
            f"{MAE_ITERS_PER_EPOCH} batches per epoch, accum_iter=2 -> 3 optimizer steps per epoch; 4 epochs; "
            "save every epoch (MAE saves every 20th and the last).",
            "Mixed precision: torch.autocast('cpu', dtype=torch.float16) around the forward and "
            "torch.amp.GradScaler('cpu') (default init_scale 65536) in a MAE-style loss-scaler wrapper "
            "(scale, backward, unscale_, clip, step, update); 'scaler' is GradScaler.state_dict(). "
            "optimizer_step is AdamW's state 'step' (GradScaler skips steps with inf gradients).",
            "Saved with the keys of MAE's misc.save_model: {'model': model_without_ddp.state_dict(), "
            "'optimizer', 'epoch', 'scaler', 'args'} to <output_dir>/checkpoint-<epoch>.pth; one process "
            "(model_without_ddp is the model). Run with the set folder as working directory and "
            "output_dir './output_dir' (a relative PosixPath in args).",
            "torch.load(path) with torch's default weights_only=True refuses these files "
            "(pathlib.PosixPath, argparse.Namespace are not allowlisted); MAE/DeiT's own torch.load calls "
            "predate that default. The oracle uses weights_only=False.",
        ]
    if kind == "nanogpt":
        meta = record.get("_meta", {})
        return [
            "A training loop in the style of nanoGPT's train.py, written for this fixture: module-level "
            "config dict saved as 'config', model_args dict, GPT with nanoGPT's module names and tied "
            "wte/lm_head weights, AdamW groups by ndim, warmup+cosine lr, gradient accumulation 2, "
            "grad_clip 1.0, GradScaler(enabled=False) (dtype float32 on CPU, no autocast).",
            f"model = torch.compile(model) (default inductor backend on CPU, gcc; compiled module "
            f"{meta.get('compiled')}; compiling takes tens of seconds on 2 cores), so "
            "raw_model.state_dict() keys start with '_orig_mod.'.",
            "eval_interval=2, always_save_checkpoint=True: at iter_num 2, 4, 6, 8 estimate_loss() runs "
            "(best_val_loss = losses['val'], a 0-d float32 tensor, as nanoGPT's estimate_loss returns) "
            "and the checkpoint dict is saved as out/ckpt_%06d.pt (nanoGPT itself overwrites out/ckpt.pt). "
            "iter_num counts optimizer steps taken before the save.",
            "The tied weights share one storage in the file ('_orig_mod.transformer.wte.weight' and "
            "'_orig_mod.lm_head.weight'); the oracle holds both keys as separate tensors.",
            "Oracle: exactly nanoGPT sample.py's load: torch.load(path, map_location) (default "
            "weights_only=True works: only dicts, numbers, strings and tensors) and the '_orig_mod.' "
            "prefix stripped from every key.",
            "Run with the set folder as working directory and out_dir 'out'.",
        ]
    history = "; ".join(
        f"epoch {s['epoch']} metric {s['metric']}: {', '.join(s['files_after'])}" for s in record["saves"]
    )
    return [
        TORCHVISION_STUB_NOTE,
        "Driven as timm's train.py does: args from an argparse parser using train.py's option names ("
        + " ".join(TIMM_CLI)
        + "), ModelEmaV3(model, decay=args.model_ema_decay, use_warmup=False) updated "
        "after every optimizer step with step=num_updates, CheckpointSaver(model, optimizer, args=args, "
        "model_ema=model_ema, amp_scaler=None, checkpoint_dir=output_dir, recovery_dir=output_dir, "
        "decreasing=(eval_metric == 'loss'), max_history=args.checkpoint_hist=2) and "
        "saver.save_checkpoint(epoch, metric=...) after each epoch. No recovery checkpoints.",
        "TinyConvNet (conv + BatchNorm2d + linear, so running_mean/var and num_batches_tracked buffers) "
        "instead of a timm model; plain torch AdamW (timm's create_optimizer_v2 would give the same "
        f"state layout); {TIMM_BATCHES_PER_EPOCH} optimizer steps per epoch, 5 epochs.",
        f"The metric is a fixed sequence {list(TIMM_EVAL_METRICS)} standing in for validate()'s loss, so "
        "the saver's own retention shows: " + history + ".",
        "How the saver writes: _save torch.saves to tmp.pth.tar, os.replace renames it to last.pth.tar, "
        "checkpoint-E.pth.tar and model_best.pth.tar are os.link hard links of last.pth.tar (copy2 only "
        "where links fail); evicted checkpoint-E files are os.remove'd. Because every file is first "
        "written as tmp.pth.tar, the zip records inside all files are under 'tmp.pth/' "
        "(torch.save names the archive after the file it writes).",
        "Each file holds 'saver' (CheckpointSaver.state_dict(): history of (file name, metric) tuples, "
        "best epoch/metric, pending) beside state_dict, state_dict_ema, optimizer, args, metric.",
        "Oracles: timm.models._helpers.load_state_dict(path, use_ema=False) and (use_ema=True) -> "
        "oracle/<file>.safetensors and oracle/<file>.ema.safetensors; it loads with weights_only=True "
        "under torch.serialization.safe_globals([argparse.Namespace]).",
        "Run with the set folder as working directory and output 'output' + experiment 'tiny' "
        "(timm.utils.get_outdir(args.output, exp_name) -> output/tiny).",
    ]


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------


def launch(set_name: str, set_dir: Path, *, nproc: int, worker: str, timeout: float = 600) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    for attempt in range(2):
        if nproc > 1:
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nproc-per-node", str(nproc), "--nnodes", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            ]  # fmt: skip
        else:
            cmd = [sys.executable]
        cmd += [str(THIS), "--worker", worker, "--set", set_name, "--set-dir", str(set_dir)]
        markers = RETRY_MARKERS if nproc > 1 and attempt == 0 else ()
        if run_worker(cmd, env=env, cwd=set_dir, label=f"{set_name}/{worker}", timeout=timeout, retry_markers=markers):
            return
        for child in set_dir.iterdir():  # start the set over
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def produce(set_name: str, out: Path) -> Path:
    spec = SETS[set_name]
    kind = spec["kind"]
    set_dir = fresh_set_dir(out, set_name)
    t0 = time.time()
    launch(set_name, set_dir, nproc=spec["nproc"], worker=kind)
    record_path = set_dir / WORKER_RECORD
    record = json.loads(record_path.read_text())
    record_path.unlink()
    if kind == "lightning":
        checkpoints = lightning_checkpoints(set_name, set_dir)
    elif kind == "mae":
        checkpoints = mae_checkpoints(set_name, set_dir, record)
    elif kind == "nanogpt":
        checkpoints = nanogpt_checkpoints(set_name, set_dir, record)
        print(
            f"[{set_name}] first iteration incl. torch.compile: {record['_meta']['first_train_iter_incl_compile_s']} s",
            flush=True,
        )
    else:
        checkpoints = timm_checkpoints(set_name, set_dir, record)
    if len(checkpoints) < 3:
        raise RuntimeError(f"{set_name}: only {len(checkpoints)} checkpoints: {sorted(checkpoints)}")
    producer = {
        "set": set_name,
        "versions": versions(kind),
        "command": f"python {SCRIPT_REL} --out tests/fixtures/trainers --set {set_name}",
        "world_size": spec["nproc"],
        "checkpoints": checkpoints,
        "notes": set_notes(set_name, record),
        "module_class_source": module_source(kind),
        "module_factory": module_factory(kind),
    }
    verify_strict(set_dir, producer)
    (set_dir / "producer.json").write_text(json.dumps(producer, indent=2) + "\n")
    print(f"[{set_name}] {len(checkpoints)} files, {time.time() - t0:.0f} s", flush=True)
    return set_dir


WORKERS = {"lightning": lightning_worker, "mae": mae_worker, "nanogpt": nanogpt_worker, "timm": timm_worker}


def main(argv: list[str] | None = None) -> int:
    return run_producer(__doc__.splitlines()[0], SETS, WORKERS, produce, argv)


if __name__ == "__main__":
    sys.exit(main())
