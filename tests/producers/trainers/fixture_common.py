"""What both trainer-fixture producers share."""

from __future__ import annotations

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
