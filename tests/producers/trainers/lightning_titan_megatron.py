"""Produce real trainer checkpoints as test fixtures: Lightning (FSDP, DeepSpeed ZeRO-3),
torchtitan (CheckpointManager, DCP and a last-step HF export) and megatron-core
(``dist_checkpointing.save`` with the ``torch_dist`` backend), each beside an ``oracle/``
folder holding every checkpoint as consolidated by the framework's own tool.

Run from the repository root with the producers' virtualenv (torch CPU, pytorch-lightning,
deepspeed, torchtitan, megatron-core, safetensors)::

    .venv-fixtures/bin/python tests/producers/trainers/lightning_titan_megatron.py \\
        --out tests/fixtures/trainers --set all

It launches ``torch.distributed.run`` (gloo, CPU, ``OMP_NUM_THREADS=1``, a free TCP port)
for each set, re-entering this file with ``--worker``. Each set is written into
``OUT/<set>/`` (deleted first; nothing else is touched):

* ``<checkpoints written by the framework's own saving code>``
* ``oracle/<checkpoint-folder-name>.safetensors``: the framework tool's consolidated model
  weights for that checkpoint, with the framework's own key names (cloned, contiguous);
* ``producer.json``: set, versions, command, checkpoints (``{"relative path":
  {"optimizer_step": N}}``), notes, and ``module_class_source`` (the Python source of the
  module used, so that a test can rebuild it and ``load_state_dict(strict=True)``).

Nothing here imitates a layout by hand: every checkpoint file comes from the framework's
saving code. Where a framework refuses to run on CPU the refusal alone is patched, and each
such patch is listed in the set's ``notes`` (``PATCHES`` below). The one file written by
hand is Megatron-LM's ``latest_checkpointed_iteration.txt`` tracker: Megatron-LM's training
loop writes it, not megatron-core.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixture_common import (
    RETRY_MARKERS,
    drop_deepspeed_scripts,
    free_port,
    fresh_set_dir,
    package_versions,
    run_producer,
    run_worker,
    write_oracle,
)
from fixture_common import TORCHRUN_VARS as _TORCHRUN_VARS

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed reads it at import (the DS oracle too)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

THIS = Path(__file__).resolve()
SCRIPT_REL = "tests/producers/trainers/lightning_titan_megatron.py"
SEED = 1234

# ---------------------------------------------------------------------------------------------
# Sets
# ---------------------------------------------------------------------------------------------

SETS: dict[str, dict] = {
    "lightning-fsdp": {"nproc": 2, "kind": "lightning", "strategy": "fsdp"},
    "lightning-deepspeed3": {"nproc": 2, "kind": "lightning", "strategy": "deepspeed3"},
    "torchtitan": {"nproc": 2, "kind": "torchtitan", "last_save_in_hf": False},
    "torchtitan-last-hf": {"nproc": 2, "kind": "torchtitan", "last_save_in_hf": True},
    "megatron-torch-dist": {"nproc": 1, "kind": "megatron", "tp": 1},
    "megatron-torch-dist-dp2": {"nproc": 2, "kind": "megatron", "tp": 1},
    "megatron-torch-dist-tp2": {"nproc": 2, "kind": "megatron", "tp": 2},
}

# Lightning: optimizer steps run, and the steps saved (two ModelCheckpoint callbacks in one
# folder: every 2 steps and every 5 steps -> 2, 4, 5, 6; 3 steps per epoch).
LIGHTNING_MAX_STEPS = 6
LIGHTNING_SAMPLES = 24  # 2 ranks x batch 4 -> 3 optimizer steps per epoch
# torchtitan: training.steps and checkpoint.interval (interval saves 2, 4; last step 5).
TITAN_STEPS = 5
TITAN_INTERVAL = 2
# megatron: iterations saved (and trained up to the last).
MEGATRON_SAVE_ITERS = (2, 5, 7)

PATCHES = {
    "lightning-fsdp": [
        "Trainer(accelerator='cpu', strategy=CPUFSDPStrategy(...)): Lightning's accelerator connector "
        "refuses `type(strategy) is FSDPStrategy` without a CUDA accelerator; CPUFSDPStrategy is an "
        "empty subclass, so the check does not fire. Nothing in FSDPStrategy is overridden.",
        "The network is wrapped in FSDP (FULL_SHARD, use_orig_params=True, device_id=cpu) by "
        "LightningModule.configure_model, so Lightning's own _setup_model (device_id=None on CPU) "
        "sees it already wrapped. Saving is FSDPStrategy.save_checkpoint with state_dict_type='sharded'.",
    ],
    "lightning-deepspeed3": [
        "CPUDeepSpeedStrategy(DeepSpeedStrategy) overrides three CUDA-only spots and nothing else: "
        "setup_environment skips the 'only supported on CUDA GPUs' check; setup_distributed skips "
        "_validate_device_index_selection (CPU devices have index None); _setup_model_and_optimizer "
        "is DeepSpeedStrategy's own body with args.device_rank=local_rank instead of "
        "root_device.index (None on CPU, which DeepSpeedEngine compares with 0).",
        "deepspeed.comm.torch.build_shm_op is replaced by a no-op: DeepSpeed's CPU accelerator would "
        "JIT-compile a shared-memory all-reduce with g++; gloo is used instead.",
        "Saving is DeepSpeedStrategy.save_checkpoint -> DeepSpeedEngine.save_checkpoint(tag='checkpoint').",
    ],
    "torchtitan": [
        "torchtitan's Trainer needs CUDA, so this script drives torchtitan's own pieces: the llama3 "
        "Llama3Model.Config (built with torchtitan.models.llama3._build_llama3_layers, tiny sizes), "
        "ParallelDims + parallelize_llama (FSDP2 over 2 ranks, spmd_backend='partial_dtensor', "
        "param dtype float32), OptimizersContainer (default_adamw, implementation='for-loop'), "
        "LRSchedulersContainer (warmup 2) and CheckpointManager.save(step, last_step=...) exactly "
        "as Trainer.train calls it.",
        "Attention: the flex config is built and each layer's inner_attention swapped to "
        "ScaledDotProductAttention.Config() (FlexAttention has no CPU backward), the same swap "
        "torchtitan's own tests make (experiments/graph_trainer/common_utils."
        "build_decoder_config_for_backend).",
        "torchtitan.distributed.parallel_dims.device_type is set to 'cpu' (it is 'cuda' whenever no "
        "accelerator is found, and init_device_mesh('cuda') fails on CPU).",
        "torchtitan.distributed.minimal_async_ep.kernels (Triton GPU kernels for MoE expert "
        "parallelism, imported by torchtitan.models.common) is replaced in sys.modules by a stub "
        "whose functions raise: triton is not installed on this CPU machine; llama3 never calls them.",
        "set_force_sum_reduction_for_comms(True) on every FSDPModule: torchtitan sets "
        "gradient_divide_factor=1.0, which FSDP2 maps to ReduceOp.PREMUL_SUM, which gloo lacks; "
        "the sum reduction is numerically the same. The loss is summed and divided by the global "
        "token count, as torchtitan's loss does.",
        "dataloader=None is given to CheckpointManager (no tokenizer/dataset on disk), so the "
        "'dataloader' entry of a full checkpoint is a pickled None; train_state is a small Stateful "
        "with Trainer.state_dict()'s keys (step, ntokens_seen).",
    ],
    "megatron": [
        "torch.cuda.current_device is replaced by `lambda: torch.device('cpu')` and "
        "torch.cuda.synchronize by a no-op, in the worker process only: megatron-core hard-codes "
        "them in GlobalMemoryBuffer (attention scores buffer), in dist_checkpointing's "
        "FileSystemWriterAsync.preload_tensors and in save_state_dict_async_finalize's failure "
        "broadcast. dist_checkpointing.save itself is unchanged.",
        "megatron.core.tensor_parallel.random.CudaRNGStatesTracker.fork is a nullcontext (it "
        "swaps CUDA RNG states around attention dropout; dropout is 0 here).",
        "position_embedding_type='learned_absolute' (RoPE moves inv_freq to torch.cuda.current_device"
        "()), TransformerConfig(use_cpu_initialization=True), get_gpt_layer_local_spec() "
        "(no Transformer Engine).",
        "The optimizer is a plain torch.optim.AdamW on the model's parameters: megatron-core's "
        "DistributedOptimizer needs its DDP wrapper and CUDA buffers. Checkpoints therefore hold the "
        "model only, plus 'iteration' and 'checkpoint_version' (3.0) as Megatron-LM puts them in "
        "the common state; Megatron-LM would also add 'args', 'rng_state' and 'optimizer'.",
        "latest_checkpointed_iteration.txt is written by this script on rank 0 after each save, "
        "exactly as Megatron-LM's training loop writes it (str(iteration), no newline).",
    ],
}


# ---------------------------------------------------------------------------------------------
# Lightning modules (their source goes into producer.json)
# ---------------------------------------------------------------------------------------------

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the producers' venv has it
    pl = None  # type: ignore[assignment]

if pl is not None:

    class TinyLitModule(pl.LightningModule):
        """A small MLP with a LayerNorm and biases, held as ``self.model``."""

        def __init__(self, lr: float = 2e-2) -> None:
            super().__init__()
            self.lr = lr
            # Sizes chosen so that 2 ranks get uneven shards (10 -> 5+5, 3 -> 2+1).
            self.model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.GELU(), nn.Linear(10, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x).float(), y.float())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    class TinyLitModuleFSDP(TinyLitModule):
        """The same module, wrapping ``self.model`` in FSDP1 on CPU (Lightning then skips its own wrap)."""

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            if not isinstance(self.model, FSDP):
                self.model = FSDP(self.model, device_id=torch.device("cpu"), use_orig_params=True)

    from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning rejects ``type(strategy) is FSDPStrategy`` without CUDA; a subclass passes."""

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        """DeepSpeedStrategy with its CUDA-only checks skipped; saving is untouched."""

        def setup_environment(self) -> None:
            # DeepSpeedStrategy.setup_environment raises unless the accelerator is CUDA.
            super(DeepSpeedStrategy, self).setup_environment()

        def setup_distributed(self) -> None:
            # DeepSpeedStrategy.setup_distributed minus _validate_device_index_selection.
            from pytorch_lightning.strategies.deepspeed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            # DeepSpeedStrategy's own body, with device_rank=local_rank (root_device.index is None).
            import deepspeed

            model_parameters = filter(lambda p: p.requires_grad, model.parameters())
            deepspeed_engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=model_parameters,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return deepspeed_engine, deepspeed_optimizer


LIGHTNING_SOURCE_HEADER = (
    "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\nimport pytorch_lightning as pl\n\n"
)


def lightning_worker(set_name: str, set_dir: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    strategy_name = SETS[set_name]["strategy"]
    if strategy_name == "deepspeed3":
        import importlib

        import deepspeed  # noqa: F401  (deepspeed.comm.torch below needs the package imported)

        importlib.import_module("deepspeed.comm.torch")
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    pl.seed_everything(SEED, workers=True)
    g = torch.Generator().manual_seed(SEED)
    data = TensorDataset(
        torch.randn(LIGHTNING_SAMPLES, 6, generator=g), torch.randn(LIGHTNING_SAMPLES, 3, generator=g)
    )
    loader = DataLoader(data, batch_size=4, shuffle=False)

    if strategy_name == "fsdp":
        module: pl.LightningModule = TinyLitModuleFSDP()
        strategy = CPUFSDPStrategy(state_dict_type="sharded", process_group_backend="gloo")
        precision = "32-true"
    else:
        module = TinyLitModule()
        strategy = CPUDeepSpeedStrategy(
            process_group_backend="gloo",
            config={
                "zero_allow_untested_optimizer": True,
                "train_micro_batch_size_per_gpu": 4,
                # persistence threshold 0: every parameter is partitioned, even the tiny ones
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            },
        )
        precision = "bf16-mixed"
    callbacks = [
        ModelCheckpoint(dirpath=set_dir, every_n_train_steps=2, save_top_k=-1),
        ModelCheckpoint(dirpath=set_dir, every_n_train_steps=5, save_top_k=-1),
    ]
    with tempfile.TemporaryDirectory(prefix="lightning-root-") as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            num_nodes=1,
            strategy=strategy,
            precision=precision,
            max_steps=LIGHTNING_MAX_STEPS,
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            deterministic=True,
        )
        trainer.fit(module, loader)


# ---------------------------------------------------------------------------------------------
# torchtitan
# ---------------------------------------------------------------------------------------------

TITAN_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
TITAN_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel",
    "copy_rows_to_peers_kernel",
    "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel",
    "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel",
    "topk_scores_grad_kernel",
)


def stub_titan_triton_kernels() -> None:
    """torchtitan.models.common imports MoE Triton kernels at import time; triton is GPU-only."""
    import types

    if TITAN_KERNELS in sys.modules:
        return
    mod = types.ModuleType(TITAN_KERNELS)
    for name in TITAN_KERNEL_NAMES:

        def _unavailable(*args, _name=name, **kwargs):
            raise RuntimeError(
                f"{TITAN_KERNELS}.{_name} needs triton (GPU); stubbed by the CPU fixture producer"
            )

        setattr(mod, name, _unavailable)
    sys.modules[TITAN_KERNELS] = mod


TITAN_DIM, TITAN_HEADS, TITAN_KV_HEADS, TITAN_LAYERS, TITAN_VOCAB, TITAN_SEQ = 16, 2, 1, 1, 32, 8


def tiny_llama3_config():
    """A tiny torchtitan llama3 config (GQA 2:1, fused QKV, untied head), SDPA attention."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model

    dim, n_heads, n_kv_heads, vocab = TITAN_DIM, TITAN_HEADS, TITAN_KV_HEADS, TITAN_VOCAB
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)
        ),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=TITAN_LAYERS,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=16),
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    # As torchtitan's tests do for SDPA: build the flex config, then swap the inner attention.
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


class TitanTrainState:
    """What torchtitan's Trainer contributes as ``states={"train_state": trainer}``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


TITAN_SOURCE_HEADER = (
    "# Rebuild: stub torchtitan's Triton kernels module first if triton is missing (see notes), then\n"
    "#   import torch; config = tiny_llama3_config()\n"
    "#   with torch.device('meta'): model = config.build()\n"
    "#   model.to_empty(device='cpu'); model.load_state_dict(oracle, strict=True)\n"
    "# (the fused wqkv is split into wq/wk/wv by FusedQKVLinear's state_dict hooks, both ways)\n"
    f"TITAN_DIM, TITAN_HEADS, TITAN_KV_HEADS, TITAN_LAYERS, TITAN_VOCAB, TITAN_SEQ = "
    f"{TITAN_DIM}, {TITAN_HEADS}, {TITAN_KV_HEADS}, {TITAN_LAYERS}, {TITAN_VOCAB}, {TITAN_SEQ}\n\n"
)


def torchtitan_worker(set_name: str, set_dir: Path) -> None:
    import torch.distributed as dist

    stub_titan_triton_kernels()
    import torchtitan.distributed.parallel_dims as parallel_dims_mod

    parallel_dims_mod.device_type = "cpu"
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Llama3StateDictAdapter, parallelize_llama

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    parallelism = ParallelismConfig(data_parallel_shard_degree=world, spmd_backend="partial_dtensor")
    training = TrainingConfig(
        mixed_precision_param="float32", local_batch_size=2, seq_len=TITAN_SEQ, steps=TITAN_STEPS
    )

    class _JobConfig:  # the fields Llama3Model.Config.update_from_config reads
        pass

    job = _JobConfig()
    job.parallelism, job.training = parallelism, training  # type: ignore[attr-defined]
    model_config = tiny_llama3_config()
    model_config.update_from_config(config=job)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()

    with torch.device("meta"):
        model = model_config.build()
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=str(set_dir),
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)  # same seed on every rank: DTensor init is rank-consistent
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    optimizer_config = default_adamw(lr=1e-2)
    optimizer_config.implementation = "for-loop"
    optimizers = optimizer_config.build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=training.steps
    )
    train_state = TitanTrainState()
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder=str(set_dir),
        interval=TITAN_INTERVAL,
        keep_latest_k=0,
        last_save_model_only=True,
        last_save_in_hf=bool(SETS[set_name]["last_save_in_hf"]),
        export_dtype="float32",
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=Llama3StateDictAdapter(model_config, None),
        base_folder="",
    )

    g = torch.Generator().manual_seed(SEED + 1 + rank)  # each rank its own data
    for step in range(1, training.steps + 1):
        train_state.step = step
        tokens = torch.randint(0, TITAN_VOCAB, (training.local_batch_size, TITAN_SEQ + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = model(inputs)
        global_tokens = labels.numel() * world
        loss = F.cross_entropy(logits.reshape(-1, TITAN_VOCAB).float(), labels.reshape(-1), reduction="sum")
        (loss / global_tokens).backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += global_tokens
        checkpointer.save(step, last_step=(step == training.steps))
    checkpointer.close()
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# megatron-core
# ---------------------------------------------------------------------------------------------

MEGATRON_LAYERS, MEGATRON_HIDDEN, MEGATRON_HEADS, MEGATRON_FFN = 2, 16, 2, 32
MEGATRON_VOCAB, MEGATRON_SEQ = 32, 8


def patch_megatron_for_cpu() -> None:
    """megatron-core hard-codes torch.cuda.current_device()/synchronize() and CUDA RNG forks."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def tiny_gpt_model(tp: int):
    """A tiny megatron-core GPTModel with the local (non Transformer Engine) layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=MEGATRON_LAYERS,
        hidden_size=MEGATRON_HIDDEN,
        num_attention_heads=MEGATRON_HEADS,
        ffn_hidden_size=MEGATRON_FFN,
        tensor_model_parallel_size=tp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=MEGATRON_VOCAB,
        max_sequence_length=2 * MEGATRON_SEQ,
        position_embedding_type="learned_absolute",
    )


MEGATRON_SOURCE_HEADER = (
    "# Rebuild in one process: torch.distributed gloo group of 1, then\n"
    "#   megatron.core.parallel_state.initialize_model_parallel(1, 1); model = tiny_gpt_model(tp=1)\n"
    "#   model.load_state_dict(oracle, strict=True)  # works without the *._extra_state entries\n"
    "import torch\n"
    f"MEGATRON_LAYERS, MEGATRON_HIDDEN, MEGATRON_HEADS, MEGATRON_FFN = "
    f"{MEGATRON_LAYERS}, {MEGATRON_HIDDEN}, {MEGATRON_HEADS}, {MEGATRON_FFN}\n"
    f"MEGATRON_VOCAB, MEGATRON_SEQ = {MEGATRON_VOCAB}, {MEGATRON_SEQ}\n\n"
)


def megatron_iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"  # Megatron-LM's get_checkpoint_name


def megatron_worker(set_name: str, set_dir: Path) -> None:
    import torch.distributed as dist

    patch_megatron_for_cpu()
    from megatron.core import dist_checkpointing, parallel_state

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    tp = int(SETS[set_name]["tp"])
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    dp_group = parallel_state.get_data_parallel_group()
    dp_size = parallel_state.get_data_parallel_world_size()

    torch.manual_seed(SEED)  # CPU init builds each master weight on every rank, then splits it
    model = tiny_gpt_model(tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(SEED + 1 + parallel_state.get_data_parallel_rank())
    positions = torch.arange(MEGATRON_SEQ).unsqueeze(0).expand(2, MEGATRON_SEQ)
    causal = torch.ones(MEGATRON_SEQ, MEGATRON_SEQ, dtype=torch.bool).tril().logical_not()
    mask = causal.view(1, 1, MEGATRON_SEQ, MEGATRON_SEQ)  # True = masked out
    for iteration in range(1, max(MEGATRON_SAVE_ITERS) + 1):
        tokens = torch.randint(0, MEGATRON_VOCAB, (2, MEGATRON_SEQ + 1), generator=g)
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])  # per-token losses [b, s]
        loss.mean().backward()
        if dp_size > 1:  # what megatron's DDP wrapper does: average gradients over data-parallel ranks
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad.div_(dp_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if iteration in MEGATRON_SAVE_ITERS:
            checkpoint_dir = set_dir / megatron_iter_name(iteration)
            if rank == 0:
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            state_dict = {
                "model": model.sharded_state_dict(),
                "iteration": iteration,
                "checkpoint_version": 3.0,
            }
            dist_checkpointing.save(state_dict, str(checkpoint_dir), sharded_strategy=("torch_dist", 1))
            dist.barrier()
            if rank == 0:  # Megatron-LM's tracker file (written by its training loop, not by core)
                (set_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
            dist.barrier()
    dist.destroy_process_group()


def megatron_oracle_worker(set_name: str, set_dir: Path) -> None:
    """dist_checkpointing.load of every checkpoint into a TP=1 model on one rank; model tensors only."""
    import torch.distributed as dist

    patch_megatron_for_cpu()
    from megatron.core import dist_checkpointing, parallel_state

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(SEED)
    model = tiny_gpt_model(1)
    oracle_dir = set_dir / "oracle"
    oracle_dir.mkdir(parents=True, exist_ok=True)
    for iteration in MEGATRON_SAVE_ITERS:
        name = megatron_iter_name(iteration)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(set_dir / name))
        if loaded.get("iteration") != iteration:
            raise SystemExit(f"{name}: common state iteration {loaded.get('iteration')!r}")
        tensors = {k: v for k, v in loaded["model"].items() if isinstance(v, torch.Tensor)}
        model.load_state_dict(loaded["model"], strict=True)  # the loaded dict fits the module exactly
        write_oracle(oracle_dir / f"{name}.safetensors", tensors, "megatron.core.dist_checkpointing.load")
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Oracles and producer.json (parent process)
# ---------------------------------------------------------------------------------------------


def lightning_oracles(set_name: str, set_dir: Path) -> dict:
    checkpoints = sorted(
        set_dir.glob("epoch=*-step=*.ckpt"), key=lambda p: int(p.name.split("step=")[1][:-5])
    )
    result = {}
    for ckpt in checkpoints:
        if SETS[set_name]["strategy"] == "fsdp":
            from lightning_fabric.utilities.load import _load_distributed_checkpoint
            from pytorch_lightning.utilities.consolidate_checkpoint import _format_checkpoint

            full = _format_checkpoint(_load_distributed_checkpoint(ckpt))
            tool = (
                "lightning_fabric.utilities.load._load_distributed_checkpoint + "
                "pytorch_lightning.utilities.consolidate_checkpoint._format_checkpoint"
            )
        else:
            from pytorch_lightning.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

            with tempfile.TemporaryDirectory(prefix="ds-oracle-") as tmp:
                chatter = io.StringIO()  # the converter prints and shows progress bars
                with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
                    full = convert_zero_checkpoint_to_fp32_state_dict(ckpt, Path(tmp) / "consolidated.pt")
            tool = "pytorch_lightning.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict"
        write_oracle(set_dir / "oracle" / f"{ckpt.name}.safetensors", full["state_dict"], tool)
        result[ckpt.name] = {"optimizer_step": int(full["global_step"])}
        step_in_name = int(ckpt.name.split("step=")[1][:-5])
        if step_in_name != full["global_step"]:
            raise SystemExit(f"{ckpt}: global_step {full['global_step']} != name")
    return result


TITAN_NON_MODEL = ("optimizer", "lr_scheduler", "dataloader", "train_state")


def torchtitan_oracles(set_name: str, set_dir: Path) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    result = {}
    steps = sorted(int(p.name.split("-")[1]) for p in set_dir.glob("step-*"))
    for step in steps:
        ckpt = set_dir / f"step-{step}"
        if (ckpt / ".metadata").is_file():
            with tempfile.TemporaryDirectory(prefix="titan-oracle-") as tmp:
                dcp_to_torch_save(ckpt, Path(tmp) / "full.pt")
                full = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)
            model = {k: v for k, v in full.items() if k not in TITAN_NON_MODEL}
            write_oracle(
                set_dir / "oracle" / f"{ckpt.name}.safetensors",
                model,
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save (model keys)",
            )
            kind = "dcp-full" if "optimizer" in full else "dcp-model-only"
            saved_step = full["train_state"]["step"] if "train_state" in full else None
            if saved_step is not None and saved_step != step:
                raise SystemExit(f"{ckpt}: train_state.step {saved_step} != {step}")
        else:
            files = sorted(ckpt.glob("model-*.safetensors"))
            if len(files) != 1:
                raise SystemExit(f"{ckpt}: expected one consolidated HF safetensors file, found {files}")
            write_oracle(
                set_dir / "oracle" / f"{ckpt.name}.safetensors",
                load_file(str(files[0])),
                f"the HF export itself ({ckpt.name}/{files[0].name}), re-saved",
            )
            kind = "hf-safetensors"
        result[ckpt.name] = {"optimizer_step": step, "kind": kind}
    return result


def megatron_oracles(set_name: str, set_dir: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    launch(set_name, set_dir, nproc=1, worker="megatron-oracle")
    result = {}
    for iteration in MEGATRON_SAVE_ITERS:
        name = megatron_iter_name(iteration)
        common = torch.load(set_dir / name / "common.pt", map_location="cpu", weights_only=False)
        if common.get("iteration") != iteration:
            raise SystemExit(f"{name}: common.pt iteration {common.get('iteration')!r}")
        # The same weights under the checkpoint's own (global, layer-stacked) keys.
        with tempfile.TemporaryDirectory(prefix="mcore-oracle-") as tmp:
            dcp_to_torch_save(set_dir / name, Path(tmp) / "full.pt")
            full = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)
        write_oracle(
            set_dir / "oracle" / "checkpoint-keys" / f"{name}.safetensors",
            {k: v for k, v in full.items() if isinstance(v, torch.Tensor)},
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save (tensors only)",
        )
        result[name] = {"optimizer_step": iteration}
    return result


def versions(kind: str) -> dict:
    names = {
        "lightning": ["pytorch-lightning", "deepspeed"],
        "torchtitan": ["torchtitan"],
        "megatron": ["megatron-core"],
    }[kind]
    out = package_versions(names)
    if kind == "lightning":
        import lightning_fabric

        out["lightning_fabric (bundled)"] = lightning_fabric.__version__
    return out


def module_source(set_name: str) -> str:
    kind = SETS[set_name]["kind"]
    if kind == "lightning":
        src = LIGHTNING_SOURCE_HEADER + textwrap.dedent(inspect.getsource(TinyLitModule))
        if SETS[set_name]["strategy"] == "fsdp":
            src += "\n\n" + textwrap.dedent(inspect.getsource(TinyLitModuleFSDP))
        return src
    if kind == "torchtitan":
        return TITAN_SOURCE_HEADER + inspect.getsource(tiny_llama3_config)
    return MEGATRON_SOURCE_HEADER + inspect.getsource(tiny_gpt_model)


def set_notes(set_name: str) -> list[str]:
    spec = SETS[set_name]
    kind = spec["kind"]
    notes = list(PATCHES[kind if kind in ("megatron", "torchtitan") else set_name])
    if kind == "lightning":
        notes += [
            f"{spec['nproc']} CPU ranks under torch.distributed.run (gloo), Lightning detects the "
            "torchelastic environment; devices=2.",
            "Two ModelCheckpoint callbacks share the folder: every_n_train_steps=2 and =5, "
            f"save_top_k=-1; max_steps={LIGHTNING_MAX_STEPS}; {LIGHTNING_SAMPLES} samples, batch 4 per "
            "rank -> 3 optimizer steps per epoch. Checkpoint names are ModelCheckpoint's default "
            "'{epoch}-{step}'.",
            "The callbacks' state (inside meta.pt / the DeepSpeed client state) records the absolute "
            "dirpath of the machine that produced the fixtures.",
            "Oracle keys are the LightningModule's state_dict keys ('model.0.weight', ...): "
            "TinyLitModule().load_state_dict(oracle, strict=True) works.",
        ]
        if spec["strategy"] == "deepspeed3":
            notes += [
                "precision='bf16-mixed': the ZeRO-3 module states hold bf16 params (empty, partitioned); "
                "the fp32 master partitions are in bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt. "
                "The oracle is the fp32 masters reconstructed by Lightning's converter.",
                "zero_to_fp32.py / zero_to_torch.py in each checkpoint folder are DeepSpeed's own copies.",
            ]
        else:
            notes.append(
                "FSDP1 SHARDED_STATE_DICT: DCP keys are 'model.<LightningModule key>' and "
                "'optimizer_0.state.<param>.<state>'; meta.pt holds the rest of the Lightning checkpoint."
            )
    elif kind == "torchtitan":
        notes += [
            f"training.steps={TITAN_STEPS}, checkpoint.interval={TITAN_INTERVAL}, keep_latest_k=0: "
            "step-2 and step-4 are full interval checkpoints (model + optimizer + lr_scheduler + "
            f"train_state + dataloader); step-{TITAN_STEPS} is the last-step save with "
            "last_save_model_only=True (torchtitan's default), export_dtype=float32.",
            "Model keys are torchtitan FQNs at the top level of the DCP state (not nested under "
            "'model'); FusedQKVLinear's state_dict hook saves wq/wk/wv (replicated DTensors, gathered "
            "from the sharded wqkv) while the optimizer state is keyed by the fused wqkv parameter.",
        ]
        if spec["last_save_in_hf"]:
            notes += [
                f"last_save_in_hf=True with Llama3StateDictAdapter(config, hf_assets_path=None): "
                f"step-{TITAN_STEPS} is written by DCP's HuggingFaceStorageWriter with HF names "
                "(model.layers.0.self_attn.q_proj.weight, ...; q/k permuted for HF RoPE) and consolidated "
                "into model-00001-of-00001.safetensors + model.safetensors.index.json; the per-rank "
                "sharded/ folder is left there by that writer.",
                f"oracle/step-{TITAN_STEPS}.safetensors is the HF export itself, re-saved with its own keys.",
            ]
    else:
        notes += [
            f"world size {spec['nproc']}, tensor_model_parallel_size={spec['tp']}, pipeline 1, data "
            f"parallel {spec['nproc'] // spec['tp']}."
            + (
                " Gradients are averaged over the data-parallel group with dist.all_reduce (what "
                "megatron's DDP wrapper would do)."
                if spec["nproc"] // spec["tp"] > 1
                else ""
            ),
            "Saved with dist_checkpointing.save({'model': model.sharded_state_dict(), 'iteration': N, "
            "'checkpoint_version': 3.0}, iter_000000N, sharded_strategy=('torch_dist', 1)): "
            ".metadata + __R_0/__R_1.distcp, common.pt (iteration, checkpoint_version), metadata.json.",
            "Checkpoint tensor keys are the ShardedTensor keys: no 'model.' prefix, transformer layers "
            "stacked along a leading dim of size num_layers ('decoder.layers.mlp.linear_fc1.weight' is "
            f"[{MEGATRON_LAYERS}, {MEGATRON_FFN}, {MEGATRON_HIDDEN}]), and the local spec's layernorms "
            "mapped to TE names ('decoder.layers.self_attention.linear_qkv.layer_norm_weight').",
            "oracle/<iter>.safetensors: dist_checkpointing.load into a TP=1 model on one rank, module "
            "state_dict keys ('decoder.layers.0.input_layernorm.weight', ...), *._extra_state (None) "
            "left out (strict load_state_dict still accepts it). oracle/checkpoint-keys/<iter>.safetensors: "
            "the same weights under the checkpoint's own keys, by dcp_to_torch_save.",
        ]
    return notes


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------





def launch(set_name: str, set_dir: Path, *, nproc: int, worker: str, timeout: float = 600) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env["PYTHONHASHSEED"] = "0"
    for attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc-per-node", str(nproc), "--nnodes", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(THIS), "--worker", worker, "--set", set_name, "--set-dir", str(set_dir),
        ]  # fmt: skip
        # A port taken between picking and binding it, or gloo's rare abort at process teardown
        # on a loaded 2-core machine: run the set again (with another free port).
        markers = RETRY_MARKERS if attempt == 0 else ()
        if run_worker(cmd, env=env, cwd=None, label=f"{set_name}/{worker}", timeout=timeout, retry_markers=markers):
            return




def produce(set_name: str, out: Path) -> Path:
    spec = SETS[set_name]
    set_dir = fresh_set_dir(out, set_name)
    launch(set_name, set_dir, nproc=spec["nproc"], worker=spec["kind"])
    kind = spec["kind"]
    if kind == "lightning":
        checkpoints = lightning_oracles(set_name, set_dir)
    elif kind == "torchtitan":
        checkpoints = torchtitan_oracles(set_name, set_dir)
    else:
        checkpoints = megatron_oracles(set_name, set_dir)
    if len(checkpoints) < 3:
        raise SystemExit(f"{set_name}: only {len(checkpoints)} checkpoints: {sorted(checkpoints)}")
    producer = {
        "set": set_name,
        "versions": versions(kind),
        "command": f"python {SCRIPT_REL} --out {out} --set {set_name}",
        "world_size": spec["nproc"],
        "checkpoints": checkpoints,
        "oracle": {name: f"oracle/{name}.safetensors" for name in checkpoints},
        "notes": set_notes(set_name) + drop_deepspeed_scripts(set_dir),
        "module_class_source": module_source(set_name),
    }
    (set_dir / "producer.json").write_text(json.dumps(producer, indent=2) + "\n")
    return set_dir


WORKERS = {
    "lightning": lightning_worker,
    "torchtitan": torchtitan_worker,
    "megatron": megatron_worker,
    "megatron-oracle": megatron_oracle_worker,
}


def main(argv: list[str] | None = None) -> int:
    return run_producer(__doc__.splitlines()[0], SETS, WORKERS, produce, argv)


if __name__ == "__main__":
    sys.exit(main())
