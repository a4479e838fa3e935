"""Produce mixture-of-experts checkpoints saved with expert parallelism as test fixtures.

megatron-core (``GPTModel`` with MoE layers, EP=2, ``dist_checkpointing.save`` with the
``torch_dist`` backend) and torchtitan (a Qwen3 MoE under FSDP2 + EP=2, ``CheckpointManager``),
each beside an ``oracle/`` folder holding every checkpoint as read by the framework's own tool.

Run from the repository root with the producers' virtualenv::

    EMA_CKPT=.venv/bin/ema-ckpt .venv-fixtures/bin/python tests/producers/trainers/moe_trainers.py \\
        --out tests/fixtures/trainers --set all

Both trainers run for real on CPU, 2 ranks on gloo under ``torch.distributed.run`` (the launch,
the oracle files and ``producer.json`` are those of ``lightning_titan_megatron.py``; the CPU
patches listed in each set's notes, ``PATCHES`` below). After producing a set, when ``EMA_CKPT``
names an ema-ckpt executable (the main virtualenv's; ema-ckpt is not installed in the producers'
one), the script averages the set with ``ema-ckpt average --last 3`` and loads the average back
with the framework's own loading code on 2 ranks with EP=2 (megatron-core's
``dist_checkpointing.load``, also into an EP=1 model on 1 rank; torchtitan's
``CheckpointManager`` with ``initial_load_path``), checking it against a float64 average of the
oracles, the router's ``expert_bias`` taken from the newest checkpoint. Nothing from that check is
written into the fixtures.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning_titan_megatron as ltm  # the dense sets' producer: launch, oracles, patches
import torch
import torch.nn.functional as F
from fixture_common import fresh_set_dir, run_producer, write_oracle

THIS = Path(__file__).resolve()
REPO = THIS.parents[3]
SCRIPT_REL = "tests/producers/trainers/moe_trainers.py"
SEED = ltm.SEED

SETS: dict[str, dict] = {
    "megatron-moe-ep2": {"nproc": 2, "kind": "megatron"},
    "torchtitan-moe-ep2": {"nproc": 2, "kind": "torchtitan"},
}

# megatron-core: 2 layers, both MoE, 4 experts of which each EP rank holds 2, top-2, sigmoid router
# with the aux-loss-free expert bias (DeepSeek-V3 style).
MOE_LAYERS, MOE_HIDDEN, MOE_HEADS, MOE_FFN, MOE_EXPERT_FFN = 2, 16, 2, 32, 8
MOE_EXPERTS, MOE_TOPK, MOE_VOCAB, MOE_SEQ = 4, 2, 32, 8
MEGATRON_SAVE_ITERS = (2, 5, 7)
# torchtitan: a Qwen3 MoE, 1 layer (see set_notes), 4 experts, top-2; steps 1..5, interval 2 -> step-2,
# step-4 (full) and step-5 (the last step, model only).
TITAN_DIM, TITAN_HEADS, TITAN_KV_HEADS, TITAN_HEAD_DIM = 16, 2, 1, 8
TITAN_LAYERS, TITAN_EXPERTS, TITAN_TOPK, TITAN_EXPERT_FFN, TITAN_VOCAB, TITAN_SEQ = 1, 4, 2, 8, 32, 8
TITAN_STEPS, TITAN_INTERVAL = 5, 2

PATCHES = {
    "megatron": [
        *ltm.PATCHES["megatron"][:2],
        "megatron.core.transformer.moe.moe_utils.te_general_gemm = None: megatron-core 0.16.1 imports "
        "te_general_gemm only inside `try: import transformer_engine`, and RouterGatingLinearFunction.forward "
        "then tests `te_general_gemm is not None` (NameError: name 'te_general_gemm' is not defined without "
        "Transformer Engine). None is what that test expects when TE is absent; the router then uses its own "
        "torch.mm path.",
        "moe_token_dispatcher_type='allgather' (megatron-core's default): the 'alltoall' dispatcher creates "
        "torch.cuda.Stream() in MoEAlltoAllTokenDispatcher.__init__ ('RuntimeError: torch.cuda.Stream requires "
        "CUDA support'); 'flex' needs DeepEP. The allgather dispatcher runs on gloo (all_gather + "
        "reduce_scatter over the TPxEP group).",
        "moe_grouped_gemm=False: experts are SequentialMLP (experts.local_experts.<i>.linear_fc1/fc2). "
        "Grouped GEMM needs Transformer Engine (TEGroupedMLP) or, with the local spec, the legacy GroupedMLP, "
        "which asserts the CUDA-only grouped_gemm package.",
        ltm.PATCHES["megatron"][2],
        "The optimizer is a plain torch.optim.AdamW on the model's parameters (megatron-core's "
        "DistributedOptimizer needs its DDP wrapper and CUDA buffers), so checkpoints hold the model only, "
        "plus 'iteration' and 'checkpoint_version' (3.0) as Megatron-LM puts them in the common state. "
        "Gradients are reduced as megatron's DDP does: dense parameters all-reduced over the data-parallel "
        "group, expert parameters (allreduce=False) over the expert-data-parallel group (size 1 here), all "
        "divided by the data-parallel size. Then megatron-core's own finalize_model_grads helpers "
        "_update_router_expert_bias and reset_model_temporary_tensors update the router's expert_bias "
        "(tokens per expert all-reduced over TPxDP) and zero local_tokens_per_expert, as finalize_model_grads "
        "does with moe_router_enable_expert_bias.",
        ltm.PATCHES["megatron"][4],
    ],
    "torchtitan": [
        "torchtitan's Trainer needs CUDA, so this script drives torchtitan's own pieces as Trainer does: a "
        "tiny Qwen3Model.Config (torchtitan.models.qwen3._build_qwen3_moe_layers: every layer MoE, "
        "AllToAllTokenDispatcher via comm_backend='standard', load_balance_coeff 1e-3 so each MoE has the "
        "expert_bias_E buffer), dist_utils.set_spmd_backend('partial_dtensor') as Trainer.__init__ calls it, "
        "ParallelDims(dp_shard=2, ep=2) + parallelize_qwen3 (FSDP2 over 2 ranks; experts sharded over the "
        "'ep' mesh dimension, FSDP over 'efsdp' of size 1), OptimizersContainer (default_adamw, "
        "implementation='for-loop') with register_moe_load_balancing_hook (the qwen3 ModelSpec's "
        "post_optimizer_build_fn: updates expert_bias_E before each optimizer step), LRSchedulersContainer "
        "(warmup 2) and CheckpointManager.save(step, last_step=...) as Trainer.train calls it.",
        "Attention: the flex config is built and each layer's inner_attention swapped to "
        "ScaledDotProductAttention.Config() (FlexAttention has no CPU backward), as torchtitan's own tests do.",
        *[p for p in ltm.PATCHES["torchtitan"] if p.startswith(("torchtitan.distributed.parallel_dims",
                                                                  "torchtitan.distributed.minimal_async_ep",
                                                                  "set_force_sum_reduction"))],
        "Expert parallelism itself runs unpatched on CPU: AllToAllTokenDispatcher's all_to_all_single on gloo, "
        "GroupedExperts' torch._grouped_mm (bfloat16) on CPU.",
        "dataloader=None is given to CheckpointManager (no tokenizer/dataset on disk); train_state is a small "
        "Stateful with Trainer.state_dict()'s keys (step, ntokens_seen).",
    ],
}


def launch(set_name: str, set_dir: Path, *, nproc: int, worker: str) -> None:
    """``lightning_titan_megatron.launch``, re-entering this file instead of that one."""
    ltm.THIS = THIS
    ltm.launch(set_name, set_dir, nproc=nproc, worker=worker)


# ---------------------------------------------------------------------------------------------
# megatron-core
# ---------------------------------------------------------------------------------------------


def patch_megatron_moe_for_cpu() -> None:
    ltm.patch_megatron_for_cpu()
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # see PATCHES["megatron"]


def tiny_moe_gpt_model(ep: int):
    """A tiny megatron-core GPTModel whose 2 layers are MoE (SequentialMLP experts), local layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=MOE_LAYERS,
        hidden_size=MOE_HIDDEN,
        num_attention_heads=MOE_HEADS,
        ffn_hidden_size=MOE_FFN,
        num_moe_experts=MOE_EXPERTS,
        moe_ffn_hidden_size=MOE_EXPERT_FFN,
        moe_router_topk=MOE_TOPK,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none",
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=MOE_EXPERTS, moe_grouped_gemm=False),
        vocab_size=MOE_VOCAB,
        max_sequence_length=2 * MOE_SEQ,
        position_embedding_type="learned_absolute",
    )


MEGATRON_SOURCE_HEADER = (
    "# Rebuild in one process: torch.distributed gloo group of 1, then\n"
    "#   megatron.core.parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)\n"
    "#   model = tiny_moe_gpt_model(ep=1); model.load_state_dict(oracle, strict=True)\n"
    "# (without Transformer Engine set megatron.core.transformer.moe.moe_utils.te_general_gemm = None first)\n"
    "import torch\n"
    f"MOE_LAYERS, MOE_HIDDEN, MOE_HEADS, MOE_FFN, MOE_EXPERT_FFN = "
    f"{MOE_LAYERS}, {MOE_HIDDEN}, {MOE_HEADS}, {MOE_FFN}, {MOE_EXPERT_FFN}\n"
    f"MOE_EXPERTS, MOE_TOPK, MOE_VOCAB, MOE_SEQ = {MOE_EXPERTS}, {MOE_TOPK}, {MOE_VOCAB}, {MOE_SEQ}\n\n"
)


def megatron_batch_inputs():
    positions = torch.arange(MOE_SEQ).unsqueeze(0).expand(2, MOE_SEQ)
    causal = torch.ones(MOE_SEQ, MOE_SEQ, dtype=torch.bool).tril().logical_not()
    return positions, causal.view(1, 1, MOE_SEQ, MOE_SEQ)  # True = masked out


def megatron_worker(set_name: str, set_dir: Path) -> None:
    import torch.distributed as dist

    patch_megatron_moe_for_cpu()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias,
        reset_model_temporary_tensors,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    dp_group, dp_size = parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_world_size()
    edp_group = parallel_state.get_expert_data_parallel_group()

    torch.manual_seed(SEED)  # CPU init builds each master weight on every rank (experts: their own)
    model = tiny_moe_gpt_model(ep=world)
    expert_params = [p for p in model.parameters() if not getattr(p, "allreduce", True)]
    if len(expert_params) != MOE_LAYERS * (MOE_EXPERTS // world) * 2:
        raise SystemExit(f"expected the local experts' fc1/fc2 weights as expert parameters, got {len(expert_params)}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(SEED + 1 + parallel_state.get_data_parallel_rank())
    positions, mask = megatron_batch_inputs()
    for iteration in range(1, max(MEGATRON_SAVE_ITERS) + 1):
        tokens = torch.randint(0, MOE_VOCAB, (2, MOE_SEQ + 1), generator=g)
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:])  # per-token losses [b, s]
        loss.mean().backward()
        for p in model.parameters():  # megatron's DDP: dense over DP, experts over expert-DP, both / DP size
            if p.grad is not None:
                expert = not getattr(p, "allreduce", True)
                dist.all_reduce(p.grad, group=edp_group if expert else dp_group)
                p.grad.div_(dp_size)
        _update_router_expert_bias([model], model.config)  # what finalize_model_grads does next
        reset_model_temporary_tensors(model.config, [model])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if iteration in MEGATRON_SAVE_ITERS:
            checkpoint_dir = set_dir / ltm.megatron_iter_name(iteration)
            if rank == 0:
                checkpoint_dir.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            state_dict = {"model": model.sharded_state_dict(), "iteration": iteration, "checkpoint_version": 3.0}
            dist_checkpointing.save(state_dict, str(checkpoint_dir), sharded_strategy=("torch_dist", 1))
            dist.barrier()
            if rank == 0:  # Megatron-LM's tracker file (written by its training loop, not by core)
                (set_dir / "latest_checkpointed_iteration.txt").write_text(str(iteration))
            dist.barrier()
    dist.destroy_process_group()


def megatron_oracle_worker(set_name: str, set_dir: Path) -> None:
    """dist_checkpointing.load of every checkpoint into an EP=1 model on one rank; model tensors only."""
    import torch.distributed as dist

    patch_megatron_moe_for_cpu()
    from megatron.core import dist_checkpointing, parallel_state

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    torch.manual_seed(SEED)
    model = tiny_moe_gpt_model(ep=1)
    oracle_dir = set_dir / "oracle"
    oracle_dir.mkdir(parents=True, exist_ok=True)
    for iteration in MEGATRON_SAVE_ITERS:
        name = ltm.megatron_iter_name(iteration)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(set_dir / name))
        if loaded.get("iteration") != iteration:
            raise SystemExit(f"{name}: common state iteration {loaded.get('iteration')!r}")
        tensors = {k: v for k, v in loaded["model"].items() if isinstance(v, torch.Tensor)}
        model.load_state_dict(loaded["model"], strict=True)
        write_oracle(oracle_dir / f"{name}.safetensors", tensors, "megatron.core.dist_checkpointing.load")
    dist.destroy_process_group()


def megatron_loadback_worker(set_name: str, work: Path) -> None:
    """dist_checkpointing.load of ``work/avg`` into an EP=world model: each rank's module tensors (its
    local experts mapped to their global index) equal ``work/expected.safetensors`` (EP=1 module keys)."""
    import re

    import torch.distributed as dist
    from safetensors.torch import load_file

    patch_megatron_moe_for_cpu()
    from megatron.core import dist_checkpointing, parallel_state

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    torch.manual_seed(SEED)
    model = tiny_moe_gpt_model(ep=world)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(work / "avg"))
    model.load_state_dict(loaded["model"], strict=True)
    want = load_file(work / "expected.safetensors")
    local = MOE_EXPERTS // world
    checked = 0
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{rank * local + int(m.group(1))}.", key)
        expected = want[name]
        error = (value.double() - expected.double()).abs().max().item()
        if not error <= 1e-6 * max(expected.abs().max().item(), 1e-30):
            raise SystemExit(f"rank {rank}: {key} (= {name}) off by {error}")
        checked += 1
    dist.barrier()
    if rank == 0:
        print(f"LOADBACK OK: dist_checkpointing.load, EP={world}, {checked} tensors per rank", flush=True)
    dist.destroy_process_group()


def megatron_oracles(set_name: str, set_dir: Path) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    launch(set_name, set_dir, nproc=1, worker="megatron-oracle")
    result = {}
    for iteration in MEGATRON_SAVE_ITERS:
        name = ltm.megatron_iter_name(iteration)
        common = torch.load(set_dir / name / "common.pt", map_location="cpu", weights_only=False)
        if common.get("iteration") != iteration:
            raise SystemExit(f"{name}: common.pt iteration {common.get('iteration')!r}")
        # The checkpoint-key view is left to the tests (dcp_to_torch_save of the committed files): the
        # fixtures stay small. Here only that it holds the same numbers as megatron's own load.
        with tempfile.TemporaryDirectory(prefix="mcore-oracle-") as tmp:
            dcp_to_torch_save(set_dir / name, Path(tmp) / "full.pt")
            full = torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=False)
        own = load_file(set_dir / "oracle" / f"{name}.safetensors")
        stacked = full["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
        for layer in range(MOE_LAYERS):
            for expert in range(MOE_EXPERTS):
                key = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight"
                if not torch.equal(stacked[layer, expert], own[key]):
                    raise SystemExit(f"{name}: dcp_to_torch_save and dist_checkpointing.load differ at {key}")
        result[name] = {"optimizer_step": iteration}
    return result


# ---------------------------------------------------------------------------------------------
# torchtitan
# ---------------------------------------------------------------------------------------------


def tiny_qwen3_moe_config():
    """A tiny torchtitan Qwen3 MoE config (GQA 2:1, fused QKV, qk-norm, every layer MoE), SDPA attention."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model

    dim, vocab = TITAN_DIM, TITAN_VOCAB
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=TITAN_LAYERS,
            dim=dim,
            n_heads=TITAN_HEADS,
            n_kv_heads=TITAN_KV_HEADS,
            head_dim=TITAN_HEAD_DIM,
            moe_hidden_dim=TITAN_EXPERT_FFN,
            num_experts=TITAN_EXPERTS,
            top_k=TITAN_TOPK,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=TITAN_HEAD_DIM, max_seq_len=64, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


TITAN_SOURCE_HEADER = (
    "# Rebuild: stub torchtitan's Triton kernels module first if triton is missing (see notes), then\n"
    "#   import torch; config = tiny_qwen3_moe_config()\n"
    "#   with torch.device('meta'): model = config.build()\n"
    "#   model.to_empty(device='cpu'); model.load_state_dict(oracle, strict=True)\n"
    f"TITAN_DIM, TITAN_HEADS, TITAN_KV_HEADS, TITAN_HEAD_DIM = "
    f"{TITAN_DIM}, {TITAN_HEADS}, {TITAN_KV_HEADS}, {TITAN_HEAD_DIM}\n"
    f"TITAN_LAYERS, TITAN_EXPERTS, TITAN_TOPK, TITAN_EXPERT_FFN, TITAN_VOCAB, TITAN_SEQ = {TITAN_LAYERS}, "
    f"{TITAN_EXPERTS}, {TITAN_TOPK}, {TITAN_EXPERT_FFN}, {TITAN_VOCAB}, {TITAN_SEQ}\n\n"
)


def build_titan_moe(set_dir: Path):
    """(model, parallel_dims, training) on this rank: torchtitan's own build and parallelize, EP=2."""
    import torch.distributed as dist

    ltm.stub_titan_triton_kernels()
    import torchtitan.distributed.parallel_dims as parallel_dims_mod
    import torchtitan.distributed.utils as dist_utils

    parallel_dims_mod.device_type = "cpu"
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.qwen3 import parallelize_qwen3

    world = dist.get_world_size()
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world, expert_parallel_degree=world, spmd_backend="partial_dtensor"
    )
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as Trainer.__init__ does
    training = TrainingConfig(
        mixed_precision_param="float32", local_batch_size=2, seq_len=TITAN_SEQ, steps=TITAN_STEPS
    )

    class _JobConfig:  # the fields Qwen3Model.Config.update_from_config reads
        pass

    job = _JobConfig()
    job.parallelism, job.training = parallelism, training  # type: ignore[attr-defined]
    model_config = tiny_qwen3_moe_config()
    model_config.update_from_config(config=job)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    parallel_dims.build_mesh()
    with torch.device("meta"):
        model = model_config.build()
    model = parallelize_qwen3(
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
    return model, model_config, parallel_dims, training


def torchtitan_worker(set_name: str, set_dir: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, model_config, parallel_dims, training = build_titan_moe(set_dir)
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        default_adamw,
        register_moe_load_balancing_hook,
    )
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    model.train()
    optimizer_config = default_adamw(lr=1e-2)
    optimizer_config.implementation = "for-loop"
    optimizers = optimizer_config.build(model_parts=[model])
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims)  # the ModelSpec's post_optimizer_build_fn
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=training.steps
    )
    train_state = ltm.TitanTrainState()
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder=str(set_dir),
        interval=TITAN_INTERVAL,
        keep_latest_k=0,
        last_save_model_only=True,
        export_dtype="float32",
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=Qwen3StateDictAdapter(model_config, None),
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
        optimizers.step()  # the pre-hook updates every MoE's expert_bias_E first
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.ntokens_seen += global_tokens
        checkpointer.save(step, last_step=(step == training.steps))
    checkpointer.close()
    dist.barrier()
    dist.destroy_process_group()


def torchtitan_loadback_worker(set_name: str, work: Path) -> None:
    """torchtitan's CheckpointManager loads ``work/avg`` as an initial model-only checkpoint into the
    EP=2 model; the gathered model state equals ``work/expected.safetensors``."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, _config, _dims, _training = build_titan_moe(work)
    from torchtitan.components.checkpoint import CheckpointManager

    with torch.no_grad():  # the loaded values must replace these, not agree with them by chance
        for tensor in model.state_dict().values():
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                (tensor.to_local() if isinstance(tensor, DTensor) else tensor).fill_(float("nan"))
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder=str(work / "empty-run"),
        initial_load_path=str(work / "avg"),
        initial_load_model_only=True,
    ).build(dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
            sd_adapter=None, base_folder="")
    if not checkpointer.load():
        raise SystemExit("CheckpointManager.load() found nothing to load")
    want = load_file(work / "expected.safetensors")
    state = model.state_dict()
    if sorted(state) != sorted(want):
        raise SystemExit(f"model keys {sorted(set(state) ^ set(want))} differ from the checkpoint's")
    for key, value in state.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        expected = want[key]
        error = (full.double() - expected.double()).abs().max().item()
        if not error <= 1e-6 * max(expected.abs().max().item(), 1e-30):
            raise SystemExit(f"rank {rank}: {key} off by {error}")
    dist.barrier()
    if rank == 0:
        print(f"LOADBACK OK: CheckpointManager(initial_load_path=...), EP={world}, {len(state)} keys", flush=True)
    checkpointer.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The load-back check of an ema-ckpt average (parent process)
# ---------------------------------------------------------------------------------------------


def is_router_statistic(key: str) -> bool:
    """The routers' load-balancing buffers, which an average takes from the newest checkpoint."""
    return key.rsplit(".", 1)[-1] in ("expert_bias", "expert_bias_E")


def expected_average(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The uniform average in float64, router statistics from the newest."""
    return {
        k: v if is_router_statistic(k) else sum(s[k].double() for s in states) / len(states)
        for k, v in states[-1].items()
    }


def loadback_check(set_name: str, set_dir: Path, checkpoints: dict) -> str | None:
    """Average the set with ema-ckpt (``EMA_CKPT``) and load the average with the framework's own code."""
    from safetensors.torch import load_file, save_file

    exe = os.environ.get("EMA_CKPT") or str(REPO / ".venv" / "bin" / "ema-ckpt")
    if not Path(exe).exists():
        print(f"[{set_name}] no ema-ckpt at {exe} (set EMA_CKPT): load-back check skipped", flush=True)
        return None
    kind = SETS[set_name]["kind"]
    names = sorted(checkpoints, key=lambda n: checkpoints[n]["optimizer_step"])[-3:]
    states = [load_file(set_dir / "oracle" / f"{n}.safetensors") for n in names]
    with tempfile.TemporaryDirectory(prefix=f"{set_name}-loadback-") as tmp:
        work = Path(tmp)
        shutil.copytree(set_dir, work / "ckpts", ignore=shutil.ignore_patterns("oracle"))
        proc = subprocess.run([exe, "average", str(work / "ckpts"), "--last", "3", "--out", str(work / "avg")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ema-ckpt average failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        save_file({k: v.float().contiguous() for k, v in expected_average(states).items()},
                  work / "expected.safetensors")
        worker = f"{kind}-loadback"
        try:
            launch(set_name, work, nproc=SETS[set_name]["nproc"], worker=worker)
            if kind == "megatron":
                launch(set_name, work, nproc=1, worker=worker)  # EP=1: megatron reshards the experts itself
        except RuntimeError as exc:
            raise RuntimeError(f"the set is written, but ema-ckpt's average of it did not load back as "
                               f"expected: {str(exc)[-3000:]}") from None
    return f"ema-ckpt average --last 3 of {', '.join(names)} loaded back by the framework's own loader"


# ---------------------------------------------------------------------------------------------
# producer.json
# ---------------------------------------------------------------------------------------------


def set_notes(set_name: str) -> list[str]:
    kind = SETS[set_name]["kind"]
    notes = list(PATCHES[kind])
    if kind == "megatron":
        notes += [
            "world size 2: tensor parallel 1, pipeline 1, expert_model_parallel_size=2 (each rank holds 2 of the "
            "4 experts of each layer), data parallel 2 for the dense parameters, expert data parallel 1.",
            f"TransformerConfig: num_moe_experts={MOE_EXPERTS}, moe_router_topk={MOE_TOPK}, moe_ffn_hidden_size="
            f"{MOE_EXPERT_FFN}, moe_router_score_function='sigmoid', moe_router_enable_expert_bias=True "
            "(moe_router_bias_update_rate 1e-3), moe_router_load_balancing_type='none' (aux-loss-free), "
            "add_bias_linear=False.",
            "Saved with dist_checkpointing.save({'model': model.sharded_state_dict(), 'iteration': N, "
            "'checkpoint_version': 3.0}, iter_000000N, sharded_strategy=('torch_dist', 1)) on both ranks: "
            ".metadata, __<rank>_0.distcp and __<rank>_1.distcp (megatron's torch_dist writer makes two "
            "files per rank), common.pt, metadata.json.",
            "Checkpoint tensor keys: layers stacked along a leading dim of size num_layers, and SequentialMLP's "
            "experts along a second one of size num_moe_experts, the expert dim sharded over the EP ranks: "
            f"'decoder.layers.mlp.experts.experts.linear_fc1.weight' is [{MOE_LAYERS}, {MOE_EXPERTS}, "
            f"{MOE_EXPERT_FFN}, {MOE_HIDDEN}] (rank 0 writes experts 0-1, rank 1 experts 2-3); the router's "
            f"'decoder.layers.mlp.router.expert_bias' is [{MOE_LAYERS}, {MOE_EXPERTS}] (float32, set by "
            "counting tokens, not by gradients). local_tokens_per_expert is a non-persistent buffer: not saved.",
            "oracle/<iter>.safetensors: dist_checkpointing.load into an EP=1 model on one rank (megatron "
            "reshards the experts), module state_dict keys ('decoder.layers.0.mlp.experts.local_experts.3."
            "linear_fc1.weight', ...), *._extra_state left out. (No oracle/checkpoint-keys/ here, unlike the "
            "dense megatron sets: the tests take the checkpoint-key view from dcp_to_torch_save themselves.)",
        ]
    else:
        notes += [
            "world size 2: ParallelismConfig(data_parallel_shard_degree=2, expert_parallel_degree=2): the "
            "routed experts' grouped weights are DTensors sharded on the expert dim over the 'ep' mesh dimension "
            "(placements (_StridedShard(dim=0, sf=2), Shard(dim=0)) over efsdp x ep); everything else FSDP2 "
            "Shard(0) over the 2 ranks.",
            f"training.steps={TITAN_STEPS}, checkpoint.interval={TITAN_INTERVAL}, keep_latest_k=0: step-2 and "
            f"step-4 are full interval checkpoints (model + optimizer + lr_scheduler + train_state + "
            f"dataloader); step-{TITAN_STEPS} is the last-step save with last_save_model_only=True, "
            "export_dtype=float32.",
            "Model keys are torchtitan FQNs at the top level of the DCP state: experts as "
            f"'layers.N.moe.routed_experts.inner_experts.w1_EFD' [{TITAN_EXPERTS}, {TITAN_EXPERT_FFN}, "
            f"{TITAN_DIM}] (w2_EDF, w3_EFD), the router 'layers.N.moe.router.gate.weight', and the "
            f"load-balancing buffer 'layers.N.moe.expert_bias_E' [{TITAN_EXPERTS}] (float32, persistent, a plain "
            "replicated tensor; set by the optimizer pre-hook from token counts). tokens_per_expert_E is "
            "non-persistent: not saved. FusedQKVLinear saves wq/wk/wv.",
            "oracle/step-N.safetensors: torch's dcp_to_torch_save, the model keys.",
            f"{TITAN_LAYERS} transformer layer (an MoE): torchtitan's full checkpoints flatten the optimizer's "
            "param_groups into ~14 pickled entries per parameter (about 1.3 KB each on disk), so a second layer "
            "made this set 1.8 MB; one layer keeps every kind of tensor (EP-sharded experts, router, expert bias).",
        ]
    notes.append(
        "After producing, with EMA_CKPT (the main virtualenv's ema-ckpt) the script averages the set "
        "(ema-ckpt average --last 3) and loads the average with the framework's own loader on 2 ranks "
        "(EP=2), megatron also on 1 rank (EP=1), against a float64 average of the oracles with the router "
        "bias from the newest checkpoint; nothing from that check is kept here."
    )
    return notes


def module_source(set_name: str) -> str:
    if SETS[set_name]["kind"] == "megatron":
        return MEGATRON_SOURCE_HEADER + inspect.getsource(tiny_moe_gpt_model)
    return TITAN_SOURCE_HEADER + inspect.getsource(tiny_qwen3_moe_config)


def produce(set_name: str, out: Path) -> Path:
    spec = SETS[set_name]
    set_dir = fresh_set_dir(out, set_name)
    kind = spec["kind"]
    launch(set_name, set_dir, nproc=spec["nproc"], worker=kind)
    if kind == "megatron":
        checkpoints = megatron_oracles(set_name, set_dir)
    else:
        checkpoints = ltm.torchtitan_oracles(set_name, set_dir)
    if len(checkpoints) < 3:
        raise SystemExit(f"{set_name}: only {len(checkpoints)} checkpoints: {sorted(checkpoints)}")
    producer = {
        "set": set_name,
        "versions": ltm.versions(kind),
        "command": f"python {SCRIPT_REL} --out {out} --set {set_name}",
        "world_size": spec["nproc"],
        "checkpoints": checkpoints,
        "oracle": {name: f"oracle/{name}.safetensors" for name in checkpoints},
        "notes": set_notes(set_name),
        "module_class_source": module_source(set_name),
    }
    (set_dir / "producer.json").write_text(json.dumps(producer, indent=2) + "\n")
    said = loadback_check(set_name, set_dir, checkpoints)
    if said:
        print(f"[{set_name}] {said}", flush=True)
    return set_dir


WORKERS = {
    "megatron": megatron_worker,
    "megatron-oracle": megatron_oracle_worker,
    "megatron-loadback": megatron_loadback_worker,
    "torchtitan": torchtitan_worker,
    "torchtitan-loadback": torchtitan_loadback_worker,
}


def main(argv: list[str] | None = None) -> int:
    return run_producer(__doc__.splitlines()[0], SETS, WORKERS, produce, argv)


if __name__ == "__main__":
    sys.exit(main())
