"""What both trainer-fixture producers share."""

from __future__ import annotations

import socket
from pathlib import Path

DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
"""DeepSpeed copies its own converter scripts into every save folder; they are code, not data,
and are not kept in the fixtures (nothing reads them)."""


def drop_deepspeed_scripts(set_dir: Path) -> list[str]:
    """Remove DeepSpeed's converter-script copies from a set; the note that says so."""
    removed = [p for name in DEEPSPEED_SCRIPTS for p in set_dir.rglob(name)]
    for path in removed:
        path.unlink()
    if not removed:
        return []
    return [f"removed {len(removed)} copies of DeepSpeed's {'/'.join(DEEPSPEED_SCRIPTS)} (code, not data)"]


TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES",
)  # fmt: skip
"""An outer launcher's variables, kept out of the producers' own torchrun launches."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
