"""Load a checkpoint with megatron-core's own ``dist_checkpointing.load``, as Megatron-LM resumes.

Run in a process of its own (a gloo group of one rank): builds the tiny GPTModel of a
``megatron-torch-dist*`` fixture from its ``producer.json`` (``module_class_source``), loads
``--ckpt`` into ``model.sharded_state_dict()``, then ``model.load_state_dict(strict=True)``, and
writes the module's tensors to ``--out`` (safetensors) with the common state's ``iteration``
in its metadata. The only patches are the fixture producer's CPU ones (megatron-core asks
``torch.cuda`` for the current device).

Usage::

    python tests/producers/megatron_load.py --fixture tests/fixtures/trainers/megatron-torch-dist \
        --ckpt ema --out loaded.safetensors
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
from pathlib import Path

import torch


def _patch_for_cpu() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixture", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch.distributed as dist
    from safetensors.torch import save_file

    _patch_for_cpu()
    from megatron.core import dist_checkpointing, parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    namespace: dict = {}
    exec(json.loads((args.fixture / "producer.json").read_text())["module_class_source"], namespace)
    model = namespace["tiny_gpt_model"](1)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(args.ckpt))
    model.load_state_dict(loaded["model"], strict=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    save_file(tensors, str(args.out), metadata={"iteration": str(loaded.get("iteration"))})
    dist.destroy_process_group()
    print("OK:", len(tensors))


if __name__ == "__main__":
    main()
