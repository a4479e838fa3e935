"""The documented quickstart commands, run verbatim.

Code blocks that follow a ``<!-- docs-test: run -->`` line in README.md, docs/index.md and
docs/getting-started.md are run in order, in a fresh working directory per page that holds
``ckpts/``: real FSDP2 checkpoints (torchrun + gloo, ``tests/producers``) named as the page names
them. Nothing in a command is substituted: ``ema-ckpt`` is the installed console script, on PATH.
A bash block runs line by line, a console block its ``$ `` lines, a python block as a script.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.producers.launch import make_fsdp_sequence

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGES = ["README.md", "docs/index.md", "docs/getting-started.md"]
MARKER = "<!-- docs-test: run -->"
PRODUCED_STEPS = [3, 7, 10, 20]  # irregular; scaled so that the newest is the step a page names

# Documented commands that cannot run here, and why (kept short: a new entry needs a reason).
SKIPPED = {
    "pip install torch==2.13.0": "installs packages: the test runs in the environment already installed",
    "pip install -e .": "installs packages: the test runs in the environment already installed",
    "pip install torch==2.13.0 && pip install -e .": "installs packages: the test runs in the environment "
                                                     "already installed",
    "ema-ckpt --install-completion": "writes to the user's shell start-up file",
    "*/30 * * * * ema-ckpt accumulate /ckpts --decay 0.999 --quiet --wait 600":
        "a crontab entry, not a shell command; /ckpts is the cluster's path",
    "torchrun --nproc-per-node 8 -m ema_ckpt accumulate /ckpts --decay 0.9999":
        "8 ranks over /ckpts, the cluster's path; tests/test_workers.py runs `torchrun -m ema_ckpt` groups",
}
# Documented commands whose documented exit status is not 0.
EXIT_STATUS = {
    "ema-ckpt diff ckpts/ema ema.safetensors": 4,  # getting-started: against the bfloat16 file it exits 4
}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    kind: str  # "shell" or "python"
    text: str

    @property
    def key(self) -> str:
        """The command without its trailing comment (how SKIPPED and EXIT_STATUS name it)."""
        return re.sub(r"\s+#.*$", "", self.text).strip() if self.kind == "shell" else self.text


def marked_blocks(page: str) -> list[tuple[int, str, list[str]]]:
    """(line number, language, lines) of each fenced block right after a marker line."""
    lines = (REPO / page).read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = lines[i + 1]
        assert fence.startswith("```"), f"{page}:{i + 2}: {MARKER} must come right before a code block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        blocks.append((i + 3, fence[3:].strip(), lines[i + 2 : end]))
    return blocks


def commands(page: str) -> list[Command]:
    """The page's marked commands, in order."""
    found = []
    for first, language, lines in marked_blocks(page):
        if language == "python":
            found.append(Command(page, first, "python", "\n".join(lines) + "\n"))
            continue
        assert language in ("bash", "console"), f"{page}:{first - 1}: a marked block is bash, console or python"
        pending = ""
        for n, line in enumerate(lines, first):
            if language == "console" and not pending:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1]
                continue
            found.append(Command(page, n, "shell", pending + line))
            pending = ""
    return found


def named_steps(page: str) -> set[int]:
    text = "\n".join("\n".join(lines) for _, _, lines in marked_blocks(page))
    return {int(n) for n in re.findall(r"ckpts/step_(\d+)", text)}


def env() -> dict[str, str]:
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if k not in launcher}
    clean.update(
        PATH=f"{BIN}{os.pathsep}{clean.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), clean.get("PYTHONPATH", "")) if p),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    return clean


def test_every_page_marks_its_commands_and_the_lists_stay_small_and_current():
    every = [c for page in PAGES for c in commands(page)]
    for page in PAGES:
        assert any(c.kind == "shell" and c.key.startswith("ema-ckpt ") for c in commands(page)), page
        # every shell block is marked (a python block may stay unmarked: loading needs the user's model)
        text = (REPO / page).read_text()
        shell_blocks = len(re.findall(r"^```(?:bash|console|sh|shell)$", text, flags=re.MULTILINE))
        assert shell_blocks == sum(lang != "python" for _, lang, _ in marked_blocks(page)), page
    keys = {c.key for c in every}
    assert len(SKIPPED) <= 6 and len(EXIT_STATUS) <= 2
    assert set(SKIPPED) <= keys, f"no longer documented: {sorted(set(SKIPPED) - keys)}"
    assert set(EXIT_STATUS) <= keys, f"no longer documented: {sorted(set(EXIT_STATUS) - keys)}"
    assert all(reason.strip() for reason in SKIPPED.values())
    # what the skip list leaves out is not ema-ckpt's own work
    assert not [k for k in SKIPPED if k.startswith("ema-ckpt ") and "--install-completion" not in k]
    # the pages say what the non-zero statuses are
    assert "exits 4" in (REPO / "docs" / "getting-started.md").read_text()


@pytest.fixture(scope="module")
def produced(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Real FSDP2 training (2 CPU ranks, gloo), model and optimizer state saved with DCP."""
    out = tmp_path_factory.mktemp("fsdp2-quickstart")
    return make_fsdp_sequence(out, kind="fsdp2", world_size=2, steps=PRODUCED_STEPS, with_optim=True)


def working_dir(tmp_path: Path, page: str, produced: list[Path]) -> Path:
    """``tmp_path/ckpts/step_N``: the produced checkpoints, named so that the page's names exist."""
    named = named_steps(page)
    scale = max(named, default=PRODUCED_STEPS[-1]) // PRODUCED_STEPS[-1]
    names = {step * scale for step in PRODUCED_STEPS}
    assert named <= names, f"{page} names ckpts/step_{sorted(named - names)}: not made by this fixture"
    for step, src in zip(PRODUCED_STEPS, produced, strict=True):
        shutil.copytree(src, tmp_path / "ckpts" / f"step_{step * scale}")
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_documented_commands_run_verbatim(page: str, produced: list[Path], tmp_path: Path) -> None:
    cwd = working_dir(tmp_path / "work", page, produced)
    run_env = env()
    found = subprocess.run(["bash", "-c", "command -v ema-ckpt"], env=run_env, capture_output=True, text=True)
    assert found.stdout.strip() == str(BIN / "ema-ckpt"), "ema-ckpt on PATH is the installed console script"
    ran = 0
    for command in commands(page):
        if command.key in SKIPPED:
            continue
        argv = ["bash", "-c", command.text] if command.kind == "shell" else [sys.executable, "-c", command.text]
        proc = subprocess.run(argv, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=300)
        expected = EXIT_STATUS.get(command.key, 0)
        assert proc.returncode == expected, (
            f"{command.page}:{command.line}: exit {proc.returncode}, documented {expected}\n{command.text}\n"
            f"--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n{proc.stderr[-2000:]}"
        )
        assert "Traceback" not in proc.stderr, f"{command.page}:{command.line}: {proc.stderr[-2000:]}"
        ran += 1
    assert ran >= 2
