"""Load a DCP checkpoint into an FSDP2-sharded TinyModel on N ranks and compare with a reference.

Run under torchrun (gloo, CPU)::

    python -m torch.distributed.run --nproc-per-node 4 tests/producers/fsdp_load_check.py \
        --ckpt DIR --expected ref.pt [--prefix model.]

``ref.pt`` holds the expected full state dict (flat keys, without the prefix). Rank 0 exits
non-zero and prints the first mismatching key when any value differs by a single bit.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_train import TinyModel, wrap


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--expected", required=True)
    parser.add_argument("--prefix", default="model.")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(123)  # different from training: every value must come from the checkpoint
    model = wrap(TinyModel(), "fsdp2")
    state = get_model_state_dict(model)
    if args.prefix:
        wrapped = {args.prefix.rstrip("."): state}
        dcp.load(wrapped, checkpoint_id=args.ckpt)
    else:
        dcp.load(state, checkpoint_id=args.ckpt)
    set_model_state_dict(model, state)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    status = 0
    if dist.get_rank() == 0:
        expected = torch.load(args.expected, weights_only=True)
        for key, value in expected.items():
            got = full[key]
            if got.dtype != value.dtype or not torch.equal(got, value):
                print(f"MISMATCH {key}: {got.dtype} vs {value.dtype}", flush=True)
                status = 1
                break
        else:
            print(f"OK {len(expected)} keys", flush=True)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo threads can abort it ("terminate called ...")
