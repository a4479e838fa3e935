"""Capture the screens shown in the docs from the real CLI, in a real 80-column terminal.

    python docs/make_screens.py           # rewrite every screen block in docs/*.md
    python docs/make_screens.py --check   # exit 1 if a block is stale (timings aside)

A screen block in a page is

    <!-- screen: NAME -->
    ```text
    ...
    ```
    <!-- /screen -->

and NAME is one of ``SCREENS`` below. The checkpoints are made here with ``dcp.save`` (a small
Llama-shaped model with its AdamW state, saved at irregular steps), in a temporary folder that
the commands see as their working directory, so the screens show short relative paths.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.terminal import run_in_terminal  # noqa: E402  (the repository's own tmux harness)

WIDTH = 80
STEPS = [200, 400, 500, 800, 1000]  # a preemption between 500 and 800
SCREENS: dict[str, list[str]] = {
    "inspect": ["inspect", "ckpts/step_1000"],
    "accumulate-dry-run": ["accumulate", "ckpts", "--half-life", "200", "--dry-run"],
    "accumulate": ["accumulate", "ckpts", "--half-life", "200"],
    "posthoc-dry-run": ["posthoc", "ckpts", "--sigma-rel", "0.05,0.10", "--out", "posthoc", "--dry-run"],
    "consolidate": ["consolidate", "ckpts/ema", "--out", "ema.safetensors"],
    "reshard": ["reshard", "ckpts/ema", "--world-size", "4", "--out", "ema-4ranks"],
    "verify": ["verify", "ckpts/ema"],
    "diff": ["diff", "ckpts/ema", "ema.safetensors"],
}
_BLOCK = re.compile(r"(<!-- screen: (?P<name>[\w-]+) -->\n)```text\n.*?```\n(<!-- /screen -->)", re.S)
_TIMING = re.compile(r"\d+(\.\d+)? ?(s|ms|µs|[KMG]iB/s)\b")


def make_checkpoints(root: Path) -> None:
    """Five DCP checkpoints of a one-layer Llama-shaped model and its AdamW state."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    hidden, ffn, vocab = 64, 176, 256
    shapes = {
        "embed_tokens.weight": (vocab, hidden),
        "layers.0.self_attn.q_proj.weight": (hidden, hidden),
        "layers.0.self_attn.k_proj.weight": (hidden // 2, hidden),
        "layers.0.self_attn.v_proj.weight": (hidden // 2, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, hidden),
        "layers.0.mlp.gate_proj.weight": (ffn, hidden),
        "layers.0.mlp.up_proj.weight": (ffn, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, ffn),
        "layers.0.input_layernorm.weight": (hidden,),
        "layers.0.post_attention_layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    model = {k: torch.randn(s) for k, s in shapes.items()}
    for step in STEPS:
        for tensor in model.values():
            tensor.add_(torch.randn_like(tensor), alpha=0.01)
        state = {key: {"step": torch.tensor(float(step)), "exp_avg": torch.randn_like(tensor) * 1e-3,
                       "exp_avg_sq": torch.rand_like(tensor) * 1e-6} for key, tensor in model.items()}
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore")
            # as an FSDP2 trainer saves: the model and the optimizer under their own roots
            dcp.save({"model": model, "optim": {"state": state}}, checkpoint_id=root / "ckpts" / f"step_{step}")


def capture(cli: str) -> dict[str, str]:
    """Every screen, as the text block the docs show (the command line first)."""
    screens = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_checkpoints(root)
        for name, args in SCREENS.items():
            screen = run_in_terminal([cli, *args], width=WIDTH, cwd=root)
            if screen.exit_code not in (0, 4):
                raise SystemExit(f"{name}: exit {screen.exit_code}\n{screen.text}")
            screens[name] = "$ ema-ckpt " + " ".join(args) + "\n" + screen.text.replace(tmp, "") + "\n"
    return screens


def _normalised(text: str) -> str:
    return _TIMING.sub("T", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks instead of rewriting them")
    parser.add_argument("--cli", default=str(Path(sys.executable).with_name("ema-ckpt")))
    options = parser.parse_args()
    screens = capture(options.cli)
    stale, used = [], set()
    for page in sorted((REPO / "docs").glob("*.md")):
        text = page.read_text()

        def replace(match: re.Match[str], page: Path = page) -> str:
            name = match["name"]
            if name not in screens:
                raise SystemExit(f"{page.name}: no screen named {name!r}")
            used.add(name)
            old = match.group(0)[len(match.group(1)) + len("```text\n"):-len("```\n" + match.group(3))]
            if _normalised(old) != _normalised(screens[name]):
                stale.append(f"{page.name}: {name}")
            return f"{match.group(1)}```text\n{screens[name]}```\n{match.group(3)}"

        new = _BLOCK.sub(replace, text)
        if new != text and not options.check:
            page.write_text(new)
    unused = sorted(set(screens) - used)
    if unused:
        print(f"screens no page shows: {', '.join(unused)}", file=sys.stderr)
    if options.check and stale:
        print("stale screens (run python docs/make_screens.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
