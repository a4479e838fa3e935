"""Score one candidate for ``ema-ckpt select``: the held-out loss of the weights in a folder.

``select`` writes each candidate as ``FOLDER/model.safetensors`` (the model's own key names) and
runs this once per candidate; the score is the ``loss`` of the JSON line printed last::

    ema-ckpt select demo/ckpts --sigma-rel 0.05:0.25:0.05 --last 4,8 \\
        --eval 'python examples/demo/score.py {path}' --metric loss --out demo/selected

Any evaluation works the same way: read the weights at ``{path}``, print a number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from task import TinyTransformer, held_out, lm_loss

HELD_OUT = 512  # sequences: the same held-out data as evaluate.py


@torch.inference_mode()
def main() -> int:
    folder = Path(sys.argv[1])
    model = TinyTransformer()
    model.load_state_dict(load_file(folder / "model.safetensors"))  # every parameter, with its shape
    data = held_out(HELD_OUT)
    loss = sum(float(lm_loss(model(seq[:, :-1]), seq)) * len(seq) for seq in data.split(256)) / len(data)
    print(json.dumps({"loss": loss, "sequences": len(data)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
