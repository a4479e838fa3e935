"""The job runner: the order lock → recover → plan → stage → compute → manifest → publish,
what a failure leaves, retries, and what runs where (on fake jobs that write small files)."""

from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import ema_ckpt
from ema_ckpt.errors import CheckpointFormatError, EmaCkptError, OptionError, UsageError
from ema_ckpt.job_context import JobContext
from ema_ckpt.jobs import Job, Target, recorded_options, run_job
from ema_ckpt.manifest import Manifest
from ema_ckpt.options import RunFields
from ema_ckpt.storage.local_publish import new_staging_dir

COMMAND_MODULES = ["commands/accumulate", "commands/averaging", "commands/consolidate", "commands/reshard",
                   "commands/diff", "commands/inspect", "folding", "plans"]


@dataclass(frozen=True)
class FileOptions(RunFields):
    out: Path
    text: str = "hello"
    overwrite: bool = False
    fail: str | None = None  # "compute", "manifest", "once"
    no_targets: bool = False
    late_seconds: float = field(default=0.0, metadata={"recorded": False})


@dataclass
class FileJob(Job[dict, list, dict]):
    """Writes ``text`` (and the writing rank) into OUT/data.txt."""

    options: FileOptions
    calls: list[str] = field(default_factory=list)

    def lock_path(self) -> Path:
        return self.options.out

    def plan(self, notes: list[str]) -> dict:
        self.calls.append("plan")
        return {"text": self.options.text, "attempt": 0, "notes": notes}

    def targets(self, plan: dict) -> list[Target]:
        return [] if self.options.no_targets else [Target(self.options.out, replace=self.options.overwrite)]

    def compute(self, plan: dict, context: JobContext) -> list:
        self.calls.append(f"compute:{plan['attempt']}")
        if self.options.fail == "compute" or (self.options.fail == "once" and plan["attempt"] == 0):
            (context.stagings[0] / "partial").write_text("half")
            raise CheckpointFormatError(self.options.out / "in", "damaged")
        ranks = context.workers.all_gather(context.workers.rank)
        if context.workers.rank == 1:
            time.sleep(self.options.late_seconds)  # the coordinator has long finished its own share
        (context.stagings[0] / f"data-{context.workers.rank}.txt").write_text(plan["text"])
        return ranks

    def manifests(self, plan: dict, computed: list) -> list[Manifest | None]:
        if self.options.fail == "manifest":
            raise UsageError("manifest failed")
        size = len(plan["text"].encode())  # each rank's file, as an output's manifest lists what it wrote
        files = {f"data-{rank}.txt": {"size": size, "crc32": zlib.crc32(plan["text"].encode())} for rank in computed}
        return [Manifest(kind="test", profile={}, dtype="float32", step=plan["attempt"], source_format="none",
                         options=recorded_options(self.options), files=files)]

    def finish_without_output(self, plan: dict) -> None:
        self.calls.append("finish_without_output")

    def retry(self, plan: dict, error: EmaCkptError) -> dict | None:
        if self.options.fail == "once" and isinstance(error, CheckpointFormatError):
            return {**plan, "attempt": plan["attempt"] + 1}
        return None

    def result(self, plan: dict, computed: list | None, seconds: float) -> dict:
        return {"plan": plan, "computed": computed, "calls": list(self.calls)}


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock"))


def test_a_run_publishes_its_output_with_its_manifest(tmp_path):
    out = tmp_path / "out"
    result = run_job(FileJob(FileOptions(out)))
    assert (out / "data-0.txt").read_text() == "hello"
    manifest = Manifest.read(out)
    assert manifest is not None and manifest.options == {"out": str(out), "text": "hello", "overwrite": False,
                                                         "fail": None, "no_targets": False}
    assert result["calls"] == ["plan", "compute:0"] and _leftovers(out) == []


def test_an_existing_output_is_kept_unless_it_may_be_replaced(tmp_path):
    out = tmp_path / "out"
    run_job(FileJob(FileOptions(out, text="first")))
    with pytest.raises(UsageError, match="exists"):
        run_job(FileJob(FileOptions(out, text="second")))
    assert (out / "data-0.txt").read_text() == "first" and _leftovers(out) == []
    run_job(FileJob(FileOptions(out, text="second", overwrite=True)))
    assert (out / "data-0.txt").read_text() == "second"


@pytest.mark.parametrize("where", ["compute", "manifest"])
def test_a_failure_leaves_the_previous_output_and_no_staging(tmp_path, where):
    out = tmp_path / "out"
    run_job(FileJob(FileOptions(out, text="first")))
    with pytest.raises(EmaCkptError):
        run_job(FileJob(FileOptions(out, text="second", overwrite=True, fail=where)))
    assert (out / "data-0.txt").read_text() == "first" and not (out / "partial").exists()
    assert _leftovers(out) == []


def test_a_retry_plans_again_under_the_same_lock_and_discards_the_failed_attempt(tmp_path):
    out = tmp_path / "out"
    result = run_job(FileJob(FileOptions(out, fail="once")))
    assert result["calls"] == ["plan", "compute:0", "compute:1"]
    assert not (out / "partial").exists() and Manifest.read(out).step == 1


def test_a_plan_without_targets_writes_nothing(tmp_path):
    out = tmp_path / "out"
    result = run_job(FileJob(FileOptions(out, no_targets=True)))
    assert result["computed"] is None and result["calls"] == ["plan", "finish_without_output"]
    assert not out.exists()


def test_recovery_runs_before_planning(tmp_path):
    out = tmp_path / "out"
    leftover = new_staging_dir(out)
    (leftover / "junk").write_text("x")
    result = run_job(FileJob(FileOptions(out)))
    assert any("left by an interrupted run" in note for note in result["plan"]["notes"])
    assert not leftover.exists()


def test_workers_receive_the_whole_job_and_only_the_coordinator_publishes(tmp_path):
    out = tmp_path / "out"
    result = run_job(FileJob(FileOptions(out, text="shared", workers=2, late_seconds=1.0)))
    assert result["computed"] == [0, 1]
    assert (out / "data-0.txt").read_text() == "shared" and (out / "data-1.txt").read_text() == "shared"


def test_options_are_frozen_and_checked_when_made_without_io(tmp_path):
    from ema_ckpt import consolidate
    from ema_ckpt.commands.accumulate import AccumulateOptions
    from ema_ckpt.commands.consolidate import ConsolidateOptions

    missing = tmp_path / "no-such-folder"  # made options look at no path
    options = ConsolidateOptions(src=missing, out=missing / "out.safetensors", format="safetensors")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = "float16"  # type: ignore[misc]
    with pytest.raises(OptionError, match="dtype must be one of") as info:
        ConsolidateOptions(src=missing, out=tmp_path / "out.safetensors", format="safetensors", dtype="int8")
    assert (info.value.option, info.value.value) == ("dtype", "int8")
    with pytest.raises(OptionError, match="include must be a tuple"):
        ConsolidateOptions(src=missing, out=tmp_path / "out.safetensors", format="safetensors", include=["x"])
    with pytest.raises(UsageError, match="exactly one"):
        AccumulateOptions(checkpoints=(missing,), decay=0.9, half_life=10.0)
    assert "workers" not in recorded_options(AccumulateOptions(checkpoints=(missing,), decay=0.9, workers=4))
    (tmp_path / "src").mkdir()
    with pytest.raises(UsageError, match="overlaps"):  # where the output goes: checked by the run, before its lock
        consolidate(tmp_path / "src", tmp_path / "src" / "out.safetensors")
    assert list((tmp_path / "src").iterdir()) == []


def test_no_command_decides_what_runs_on_the_coordinator():
    root = Path(ema_ckpt.__file__).parent
    for name in COMMAND_MODULES:
        text = (root / f"{name}.py").read_text()
        assert "is_coordinator" not in text and "run_workers" not in text, name
