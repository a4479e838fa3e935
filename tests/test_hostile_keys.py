"""Key names are untrusted text: any Unicode key either works end to end or is refused in one line."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

from ema_ckpt.cli import app
from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.commands.reshard import reshard
from ema_ckpt.errors import EmaCkptError

runner = CliRunner()

# Surrogates, controls (ESC, OSC's BEL, newlines), bidi overrides, path-like and very long names.
_hostile = st.sampled_from(
    ["\udcff", "\x1b[2J", "\x1b]0;x\x07", "\n", "\r", "\u202e", "/", "..", "[red]", "\x00", "\u2028"]
)
keys = st.lists(
    st.one_of(
        st.text(min_size=1, max_size=12),
        st.builds(lambda a, h, b: a + h + b, st.text(max_size=4), _hostile, st.text(max_size=4)),
        st.just("w" * 300),
    ),
    min_size=1, max_size=3, unique=True,
)


def _ok_or_one_line(result) -> bool:
    """The CLI either worked or said one line (no traceback, no raw control character)."""
    text = result.output
    if "\x1b" in text or "Traceback" in text:
        return False
    return result.exit_code == 0 or (result.exit_code in (2, 3) and len(text.strip().splitlines()) == 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names=keys)
def test_any_key_works_or_is_refused_in_one_line(names):
    root = Path(tempfile.mkdtemp())
    try:
        state = {name: torch.full((3, 2), float(i)) for i, name in enumerate(names)}
        for step in (1, 2):
            dcp.save({k: v + step for k, v in state.items()}, checkpoint_id=str(root / "c" / f"step_{step}"),
                     no_dist=True)
        ckpt = root / "c" / "step_2"
        for command in (["inspect", str(ckpt)], ["diff", str(root / "c" / "step_1"), str(ckpt)], ["verify", str(ckpt)]):
            result = runner.invoke(app, command)
            assert _ok_or_one_line(result) or (command[0] == "diff" and result.exit_code == 4), (command, result.output)
        for out in ("m.safetensors", "m.pt", "hf"):
            try:
                consolidate(ckpt, root / out, format="hf-sharded" if out == "hf" else None)
            except EmaCkptError as err:
                assert "\n" not in str(err).strip() and not (root / out).exists()
                assert any(not _utf8(n) or n == "__metadata__" for n in names), err
                continue
            if out == "m.safetensors":
                assert sorted(load_file(root / out)) == sorted(names)
            elif out == "m.pt":
                assert sorted(torch.load(root / out, weights_only=True)) == sorted(names)
            else:
                index = root / out / "model.safetensors.index.json"
                files = [root / out / f for f in json.loads(index.read_text())["weight_map"].values()] \
                    if index.exists() else [root / out / "model.safetensors"]
                assert sorted(k for f in set(files) for k in load_file(f)) == sorted(names)
        accumulate(root / "c", decay=0.5, out=root / "ema")
        reshard(root / "ema", world_size=2, out=root / "r")
        for folder in (root / "ema", root / "r"):
            loaded = {k: torch.empty(3, 2) for k in names}
            dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
            for i, name in enumerate(names):
                assert torch.equal(loaded[name], torch.full((3, 2), i + 1.5)), name
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
