"""--workers N and torchrun: the same bytes whatever the number of workers, errors on every rank."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ema_ckpt.commands.accumulate import accumulate
from ema_ckpt.commands.averaging import posthoc
from ema_ckpt.commands.consolidate import consolidate
from ema_ckpt.commands.reshard import reshard
from ema_ckpt.dist import WorkerFailed, Workers, assign_by_bytes, current_workers
from ema_ckpt.dist.pool import run_workers
from ema_ckpt.errors import EmaCkptError, OptionError, UsageError
from tests.dcp_helpers import write_dcp
from tests.torchrun import torchrun
from tests.waiting import wait_for


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sequence(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seq")
    g = torch.Generator().manual_seed(3)
    for step in (10, 25, 26, 60):
        tensors = {f"model.layer{i}.weight": torch.randn(17 + i, 9, generator=g) for i in range(6)}
        tensors["model.norm"] = torch.randn(9, generator=g).bfloat16()
        tensors["model.count"] = torch.tensor(step)
        write_dcp(root / f"step_{step}", tensors, world_size=3)
    return root


def test_assignment_balances_bytes_deterministically():
    sizes = [10, 1, 1, 1, 9]
    owners = assign_by_bytes(sizes, 2)
    assert owners == assign_by_bytes(sizes, 2)
    assert sorted(sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(2)) == [11, 11]
    assert assign_by_bytes([], 3) == []


def test_accumulate_and_posthoc_bytes_do_not_depend_on_workers(sequence, tmp_path):
    accumulate(sequence, decay=0.9, out=tmp_path / "one")
    accumulate(sequence, decay=0.9, out=tmp_path / "two", workers=2)
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")
    accumulate(sequence, sigma_rels=["0.1", "0.2"], snapshot_every=20, out=tmp_path / "p1")
    accumulate(sequence, sigma_rels=["0.1", "0.2"], snapshot_every=20, out=tmp_path / "p3", workers=3)
    assert _tree(tmp_path / "p1") == _tree(tmp_path / "p3") and (tmp_path / "p1" / "snapshots").is_dir()
    posthoc(sequence, out=tmp_path / "h1", sigma_rels=["0.05:0.2:0.05"])
    result = posthoc(sequence, out=tmp_path / "h2", sigma_rels=["0.05:0.2:0.05"], workers=2)
    assert len(result.outputs) == 4 and _tree(tmp_path / "h1") == _tree(tmp_path / "h2")


def test_posthoc_from_snapshots_is_the_same_bytes_in_every_process(sequence, tmp_path):
    # snapshots of two profiles share each step: their order in the sum must not follow set order
    accumulate(sequence, sigma_rels=["0.05", "0.2"], snapshot_every=20, out=tmp_path / "snap")
    snapshots = tmp_path / "snap" / "snapshots"
    posthoc(snapshots, out=tmp_path / "w2", sigma_rels=["0.04"], workers=2)
    for seed in ("1", "2", "3"):
        code = ("from ema_ckpt.commands.averaging import posthoc; "
                f"posthoc({str(snapshots)!r}, out={str(tmp_path / seed)!r}, sigma_rels=['0.04'])")
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        assert _tree(tmp_path / seed) == _tree(tmp_path / "w2"), f"PYTHONHASHSEED={seed}"


def test_reshard_and_consolidate_bytes_do_not_depend_on_workers(sequence, tmp_path):
    ck = sequence / "step_60"
    reshard(ck, world_size=4, out=tmp_path / "r1")
    reshard(ck, world_size=4, out=tmp_path / "r2", workers=2)
    assert _tree(tmp_path / "r1") == _tree(tmp_path / "r2")
    consolidate(ck, tmp_path / "c1", format="hf-sharded", max_shard_size="1KB")
    consolidate(ck, tmp_path / "c2", format="hf-sharded", max_shard_size="1KB", workers=2)
    assert _tree(tmp_path / "c1") == _tree(tmp_path / "c2") and len(_tree(tmp_path / "c1")) > 3
    consolidate(ck, tmp_path / "s2.safetensors", workers=2)
    consolidate(ck, tmp_path / "s1.safetensors")
    assert (tmp_path / "s1.safetensors").read_bytes() == (tmp_path / "s2.safetensors").read_bytes()


def test_an_error_on_any_worker_is_one_clean_error(sequence, tmp_path):
    broken = tmp_path / "ck"
    for step in (10, 60):
        (broken / f"step_{step}").mkdir(parents=True)
        for item in (sequence / f"step_{step}").iterdir():
            (broken / f"step_{step}" / item.name).write_bytes(item.read_bytes())
    data = broken / "step_60" / "__2_0.distcp"
    data.write_bytes(data.read_bytes()[:50])  # worker-owned file, truncated
    with pytest.raises(EmaCkptError, match="truncated") as info:
        accumulate(broken, decay=0.9, out=tmp_path / "ema", workers=2)
    assert info.value.exit_code == 3
    assert not (tmp_path / "ema").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ema.tmp")]


def test_metadata_parsed_by_one_worker_fails_cleanly_on_all(sequence, tmp_path):
    broken = tmp_path / "ck"
    for step in (10, 25, 60):
        (broken / f"step_{step}").mkdir(parents=True)
        for item in (sequence / f"step_{step}").iterdir():
            (broken / f"step_{step}" / item.name).write_bytes(item.read_bytes())
    (broken / "step_25" / ".metadata").write_bytes(b"\x80\x04garbage")  # input 1: parsed by worker 1
    with pytest.raises(EmaCkptError, match=r"step_25/\.metadata") as info:
        posthoc(broken, out=tmp_path / "out", sigma_rels=["0.1"], workers=2)
    assert info.value.exit_code == 3 and not list((tmp_path / "out").glob("*"))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_torchrun_runs_the_same_command(sequence, tmp_path):
    accumulate(sequence, decay=0.95, out=tmp_path / "single")
    proc = torchrun(["-m", "ema_ckpt", "accumulate", str(sequence), "--decay", "0.95",
                     "--out", str(tmp_path / "torchrun"), "--json"],
                    before_retry=lambda: shutil.rmtree(tmp_path / "torchrun", ignore_errors=True))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"out"') == 1  # only rank 0 reports
    assert _tree(tmp_path / "single") == _tree(tmp_path / "torchrun")


def test_cli_workers_option(sequence, tmp_path):
    from typer.testing import CliRunner

    from ema_ckpt.cli import app

    result = CliRunner().invoke(app, ["average", str(sequence), "--last", "2", "--out", str(tmp_path / "avg"),
                                      "--workers", "2", "--json"])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["accumulate", str(sequence), "--decay", "0.9", "--device", "cuda",
                                   "--out", str(tmp_path / "x")])
    if not torch.cuda.is_available():
        assert bad.exit_code == 2 and "no CUDA device" in bad.stderr


def _dies_on_rank_one(marker: str) -> str:
    workers = current_workers()
    if workers.rank == 1:
        os._exit(9)  # killed mid-run: no report, no error message
    workers.all_gather(marker)  # rank 0 waits here for a peer that is gone
    return marker


def _fails_on_rank_one() -> str:
    workers = current_workers()

    def step() -> str:
        if workers.rank == 1:
            raise UsageError("only rank 1 sees this")
        return "rank 0 ran"

    return workers.run(step)


def _reports_its_place() -> tuple[int, int, int]:
    workers = current_workers()
    return workers.rank, workers.world_size, os.getpid()


def test_this_process_is_rank_zero_and_leaves_no_trace():
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    threads = torch.get_num_threads()
    rank, world, pid = run_workers(2, _reports_its_place)
    assert (rank, world, pid) == (0, 2, os.getpid())
    assert {k: os.environ.get(k) for k in before} == before
    assert torch.get_num_threads() == threads
    assert not torch.distributed.is_initialized()
    assert run_workers(2, _reports_its_place)[:2] == (0, 2)  # and a second run in the same process works


def test_an_error_on_a_spawned_worker_reaches_the_caller():
    with pytest.raises(EmaCkptError, match="only rank 1 sees this") as info:
        run_workers(2, _fails_on_rank_one)
    assert info.value.exit_code == UsageError("x").exit_code


def _option_error_on_rank_one(at_sync: bool) -> str:
    workers = current_workers()

    def step() -> str:
        if workers.rank == 1:
            raise OptionError("at_step", "5 is before the first checkpoint (step 10)", value=5)
        return "rank 0 ran"

    return workers.run(step) if at_sync else step()


@pytest.mark.parametrize(("at_sync", "prefix"), [(True, "worker 1: "), (False, "")])
def test_a_workers_error_reaches_rank_zero_with_its_data(at_sync, prefix):
    from ema_ckpt.cli._errors import error_message

    with pytest.raises(WorkerFailed) as info:
        run_workers(2, _option_error_on_rank_one, at_sync)
    assert str(info.value) == prefix + "at_step 5 is before the first checkpoint (step 10)"
    assert error_message(info.value) == (prefix + "--at-step 5 is before the first checkpoint (step 10)", 2)


def test_a_worker_that_dies_without_a_word_is_one_clean_error():
    with pytest.raises(WorkerFailed, match="died without a report") as info:
        run_workers(2, _dies_on_rank_one, "x")
    assert info.value.exit_code == 1
    assert not torch.distributed.is_initialized()


def _exchanges() -> tuple[bool, list]:
    workers = current_workers()
    value = {"rank": workers.rank, "payload": list(range(workers.rank + 3))}
    gathered = workers.exchange(value)
    return gathered[workers.rank] is value, gathered


def test_exchange_gives_every_rank_every_value_and_its_own_unchanged():
    own_is_same_object, gathered = run_workers(2, _exchanges)
    assert own_is_same_object
    assert gathered == [{"rank": 0, "payload": [0, 1, 2]}, {"rank": 1, "payload": [0, 1, 2, 3]}]


def test_frozen_heap_nests_and_leaves_a_callers_own_freeze_alone():
    import gc

    from ema_ckpt._gc import frozen_heap, paused_gc

    assert gc.get_freeze_count() == 0
    with frozen_heap():
        outer = gc.get_freeze_count()
        made_inside = [[] for _ in range(1000)]  # lists: tracked by the collector
        with frozen_heap():  # a nested block sets aside what was made since
            assert gc.get_freeze_count() >= outer + 1000
        assert gc.get_freeze_count() >= outer + 1000  # still frozen until the outermost block ends
    assert gc.get_freeze_count() == 0 and made_inside
    gc.freeze()  # a caller's own freeze (before a fork, say)
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        # neither unfrozen nor frozen again (frozen objects other threads free meanwhile leave the count)
        assert frozen - 1000 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_console_script_spares_spawned_workers_the_cli_import():
    code = "import sys, ema_ckpt._entry; assert 'typer' not in sys.modules and 'ema_ckpt.cli' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_workers_refuse_a_process_that_already_has_a_group(tmp_path):
    code = (
        "import torch.distributed as dist\n"
        "from ema_ckpt.dist.pool import run_workers\n"
        "from tests.torchrun import free_port\n"
        "from ema_ckpt.errors import UsageError\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "try:\n"
        "    run_workers(2, print)\n"
        "except UsageError as err:\n"
        "    assert 'torchrun' in str(err)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "assert dist.is_initialized()  # the caller's group is left alone\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _rank_zero_breaks_between_steps() -> None:
    workers = current_workers()
    if workers.rank == 0:
        raise RuntimeError("rank 0 broke between steps")
    workers.all_gather("waiting")  # rank 1 waits in a collective for a peer that never comes


def test_rank_zeros_own_fault_is_the_error_reported_not_a_dead_peer(monkeypatch):
    import time

    monkeypatch.setenv("EMA_CKPT_PEER_TIMEOUT", "600")  # a run that waited for rank 1 would take that long
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="worker 0: RuntimeError: rank 0 broke between steps"):
        run_workers(2, _rank_zero_breaks_between_steps)
    assert time.monotonic() - started < 120  # starting the workers, not waiting for one
    assert not torch.distributed.is_initialized()


def test_progress_reports_rank_zeros_share_with_workers(sequence, tmp_path):
    events = []
    accumulate(sequence, decay=0.9, out=tmp_path / "two", workers=2, on_progress=events.append)
    accumulate(sequence, decay=0.9, out=tmp_path / "one")
    assert _tree(tmp_path / "two") == _tree(tmp_path / "one")
    assert events and events[-1].bytes_done == events[-1].bytes_total > 0
    assert [e.bytes_done for e in events] == sorted(e.bytes_done for e in events)


def _rank_one_fails_alone() -> None:
    workers = current_workers()
    if workers.rank == 1:
        raise ValueError("rank 1 broke on its own")
    workers.all_gather("waiting")  # rank 0 then fails in this collective: the peer has gone


def test_a_peers_own_fault_is_reported_not_the_collective_it_broke():
    with pytest.raises(WorkerFailed, match="rank 1 broke on its own"):
        run_workers(2, _rank_one_fails_alone)
    assert not torch.distributed.is_initialized()


def _dies_before_joining() -> None:
    if os.environ.get("RANK") == "1":
        os._exit(3)  # before it ever reaches the group
    current_workers().all_gather("x")


def test_a_worker_that_dies_before_joining_ends_the_run_at_once():
    import time

    started = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"worker 1 \(process \d+\) died without a report \(exit code 3"):
        run_workers(2, _dies_before_joining)
    assert time.monotonic() - started < 60  # not the join timeout (300 s), let alone torch's hours


def _stops_on_rank_one() -> str:
    import signal

    workers = current_workers()
    if workers.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, sockets open, silent
    workers.all_gather("x")
    return "finished"


def test_a_silent_worker_is_lost_within_the_peer_timeout(monkeypatch):
    import multiprocessing
    import time

    from ema_ckpt.errors import PeerLostError

    monkeypatch.setenv("EMA_CKPT_PEER_TIMEOUT", "2")
    started = time.monotonic()
    with pytest.raises(PeerLostError, match="worker 1 has not answered for 2 s") as info:
        run_workers(2, _stops_on_rank_one)
    assert time.monotonic() - started < 120 and info.value.exit_code == 8  # the workers' start, then 2 s
    assert not multiprocessing.active_children()  # the stopped worker was killed, not left behind


def _claim_files(costs: list[int], slow_rank: int) -> list[list[int]]:
    import time

    workers = current_workers()
    workers.all_gather(None)  # both start together
    taken = []
    for index in workers.claims(costs):
        taken.append(index)
        # the work on one file; one worker slowed down (another load on its core, a slower node)
        time.sleep(0.4 if workers.rank == slow_rank else 0.05)
    return workers.all_gather(taken)


def test_workers_claim_files_in_turn_so_a_slow_worker_takes_fewer():
    costs = [5, 9, 5, 5, 1, 5, 5, 5, 5, 5, 2, 5]
    shares = run_workers(2, _claim_files, costs, 1)
    assert sorted(shares[0] + shares[1]) == list(range(len(costs)))  # each file exactly once
    assert len(shares[0]) > len(shares[1]) >= 1
    order = Workers(0, 2).claim_order(costs)
    assert order[0] == 1 and order[-1] == 4  # largest first
    for share in shares:
        assert share == sorted(share, key=order.index)


def _who_works() -> list[tuple[int, str | None]]:
    workers = current_workers()
    return workers.all_gather((os.getpid(), os.environ.get("EMA_CKPT_TEST_MARK")))


def test_workers_started_ahead_take_the_next_job_with_its_environment(monkeypatch):
    from ema_ckpt.dist import pool as dist_pool

    dist_pool.start_standby_workers(1)
    started = [proc.pid for proc in dist_pool._standby["procs"]]
    monkeypatch.setenv("EMA_CKPT_TEST_MARK", "set after the start")
    gathered = run_workers(2, _who_works)
    assert gathered == [(os.getpid(), "set after the start"), (started[0], "set after the start")]
    assert not dist_pool._standby
    assert run_workers(2, _who_works)[1][0] not in started  # used once; the next run starts its own


def test_workers_started_ahead_for_another_count_are_ended_and_replaced():
    from ema_ckpt.dist import pool as dist_pool

    dist_pool.start_standby_workers(2)
    started = list(dist_pool._standby["procs"])
    gathered = run_workers(2, _who_works)
    assert gathered[1][0] not in [p.pid for p in started]
    for proc in started:
        proc.join(timeout=120)
        assert proc.exitcode is not None


def test_workers_started_ahead_end_with_a_command_that_never_used_them(tmp_path):
    script = ("import sys; from ema_ckpt.dist import pool as dist_pool; dist_pool.start_standby_workers(1); "
              "print(dist_pool._standby['procs'][0].pid, flush=True); sys.exit(3)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    pid = int(proc.stdout.split()[0])

    def ended() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        return state == "Z"  # exited, not yet reaped by its new parent

    wait_for(ended, what=f"worker {pid} to end with its command (it outlived it)", every=0.1)


@pytest.mark.parametrize(("words", "count"), [
    (["average", "c", "--workers", "2"], 2),
    (["average", "c", "--workers=3"], 3),
    (["average", "c", "-j", "4"], 4),
    (["average", "c", "-j4"], 4),
    (["average", "c", "-j", "many"], 1),
    (["average", "c"], 1),
    (["average", "c", "-j", "2", "--dry-run"], 1),
    (["average", "--help", "-j", "2"], 1),
    (["average", "--", "--workers", "2"], 1),
    (["average", "c", "--workers", "100000"], 1),
    (["average", "c", "--workers", "\u00b2"], 1),  # a digit to str.isdigit, not to int()
])
def test_the_worker_count_is_read_ahead_only_where_the_words_say_it(words, count):
    from ema_ckpt._entry import workers_requested

    assert workers_requested(words) == count


def _stop_after_one(costs: list[int]) -> list[list[int]]:
    workers = current_workers()
    claims = workers.claims(costs)
    taken = []
    if workers.rank == 1:
        taken.append(next(claims))
        claims.stop()  # as a worker that failed on its file does
    workers.all_gather(None)
    taken.extend(claims)
    return workers.all_gather(taken)


def test_a_worker_that_fails_leaves_nothing_more_to_claim():
    shares = run_workers(2, _stop_after_one, [5] * 8)
    assert shares == [[], [0]]


def test_workers_started_ahead_end_when_the_run_needs_none():
    from ema_ckpt.dist import pool as dist_pool

    dist_pool.start_standby_workers(1)
    started = list(dist_pool._standby["procs"])
    assert run_workers(1, os.getpid) == os.getpid()
    assert not dist_pool._standby and all(proc.exitcode is not None for proc in started)
