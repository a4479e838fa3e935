"""The EMA loop users write today: full loads per checkpoint, lerp_, dcp.save.

Usage: python benchmarks/handwritten_ema.py OUT DECAY CKPT...
"""

from __future__ import annotations

import sys
import warnings

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

warnings.filterwarnings("ignore")
out, decay, ckpts = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
steps = [int(c.rstrip("/").rsplit("_", 1)[1]) for c in ckpts]
ema = None
for i, ckpt in enumerate(ckpts):
    state = _load_state_dict_from_keys(checkpoint_id=ckpt)["model"]
    if ema is None:
        ema = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    else:
        weight = 1 - decay ** (steps[i] - steps[i - 1])
        for k, v in state.items():
            if v.is_floating_point():
                ema[k].lerp_(v.float(), weight)
            else:
                ema[k] = v
    del state
dcp.save({"model": ema}, checkpoint_id=out, no_dist=True)
