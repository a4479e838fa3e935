"""Two real torchrun agents (two "nodes") on loopback, and in two network namespaces where root.

The output is the bytes of one worker; a node that stops answering, loses its launcher or never
comes ends the run on the other within a bound, with one line, no process left behind and the
previous EMA intact.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from tests.dcp_helpers import write_dcp
from tests.torchrun import free_port
from tests.waiting import listening_on, wait_for

PEER_TIMEOUT = 4  # EMA_CKPT_PEER_TIMEOUT in these tests (60 s by default)
BOUND = PEER_TIMEOUT + 5 + 40  # silence + the hard-exit grace + torchrun tearing down its agent


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _write_sequence(root: Path, steps: list[int], *, size: int = 64) -> None:
    g = torch.Generator().manual_seed(7)
    for step in steps:
        tensors = {f"model.layer{i}.weight": torch.randn(size, 1024, generator=g) for i in range(8)}
        tensors["model.norm"] = torch.randn(1024, generator=g).bfloat16()
        tensors["model.count"] = torch.tensor(step)
        write_dcp(root / f"step_{step}", tensors, world_size=2)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "EMA_CKPT_PEER_TIMEOUT": str(PEER_TIMEOUT),
            "EMA_CKPT_JOIN_TIMEOUT": "60", **extra}


def _agent_command(endpoint: str, run_id: str, args: list[str], *, nproc: int = 1,
                   rdzv_conf: str = "join_timeout=60,read_timeout=20", local_addr: str | None = None,
                   host: bool | None = None) -> list[str]:
    """One node's torchrun; ``host`` says whether it hosts the rendezvous store (a test that kills
    a node must know which one does: on one machine either agent could bind the endpoint first)."""
    if host is not None:
        rdzv_conf += f",is_host={int(host)}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", rdzv_conf,
           "--max-restarts", "0"]
    if local_addr is not None:
        cmd += ["--local-addr", local_addr]
    return [*cmd, "-m", "ema_ckpt", *args]


def _start(cmd: list[str], log: Path, env: dict[str, str], prefix: list[str] | None = None) -> subprocess.Popen:
    handle = log.open("w")
    return subprocess.Popen([*(prefix or []), *cmd], stdout=handle, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for_staging(out: Path, agents: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list(out.parent.glob(f".{out.name}.tmp-*")):
        assert all(a.poll() is None for a in agents), "a node ended before the run began"
        assert time.monotonic() < deadline, "the run never began"
        time.sleep(0.005)


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def sequence(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multinode") / "ckpts"
    _write_sequence(root, [100, 200, 300])
    return root


def _two_nodes(args: list[str], tmp_path: Path, *, nproc: int = 1) -> tuple[list[subprocess.Popen], list[Path]]:
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    agents = [_start(_agent_command(endpoint, run_id, args, nproc=nproc, host=True), logs[0], _env())]
    agents.append(_start(_agent_command(endpoint, run_id, args, nproc=nproc, host=False), logs[1], _env()))
    return agents, logs


RECIPE = Path(__file__).resolve().parents[1] / "docs" / "recipes" / "multi-node.md"


def _recipe_command(endpoint: str, run_id: str, run: Path) -> list[str]:
    """The two-node command of docs/recipes/multi-node.md, with this test's address and paths."""
    text = RECIPE.read_text()
    block = text.split("## Two nodes", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    line = block.replace("\\\n", " ").replace('"$HEAD:29500"', endpoint).replace("$RUN", str(run))
    words = shlex.split(line)
    assert words[0] == "torchrun" and "--rdzv-id" in words
    words[words.index("--rdzv-id") + 1] = run_id
    return [sys.executable, "-m", "torch.distributed.run", *words[1:]]


def test_the_recipes_two_nodes_with_two_ranks_each_write_the_bytes_of_one_worker(sequence, tmp_path):
    """The recipe's line as written (with two ranks per node and --json): four workers write the
    bytes one worker writes, and rank 0 alone reports."""
    from ema_ckpt.commands.accumulate import accumulate

    run = tmp_path / "run"
    shutil.copytree(sequence, run / "ckpts")
    accumulate(run / "ckpts", decay=0.95, out=tmp_path / "single")
    port = free_port()
    endpoint, run_id = f"127.0.0.1:{port}", uuid.uuid4().hex[:8]
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    command = _recipe_command(endpoint, run_id, run)
    command[command.index("--nproc-per-node") + 1] = "2"
    agents = [_start([*command, "--json"], logs[0], _env())]
    wait_for(lambda: listening_on(port) or agents[0].poll() is not None,
             what="the first agent to host the rendezvous store")
    agents.append(_start([*command, "--json"], logs[1], _env()))
    for agent, log in zip(agents, logs, strict=True):
        assert agent.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert sum(log.read_text().count('"out"') for log in logs) == 1  # only rank 0 reports
    assert _tree(tmp_path / "single") == _tree(run / "ema")


def _previous_ema(tmp_path: Path, sequence: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """An EMA of two checkpoints, then four larger ones to fold (a run long enough to cut)."""
    from ema_ckpt.commands.accumulate import accumulate

    live, out = tmp_path / "ckpts", tmp_path / "ema"
    _write_sequence(live, [100, 200], size=2048)
    accumulate(live, decay=0.95, out=out)
    _write_sequence(live, [300, 400, 500, 600, 700, 800], size=2048)
    return live, out, _tree(out)


def _one_error_line(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def test_a_node_that_stops_answering_ends_the_run_within_the_bound(sequence, tmp_path):
    live, out, before = _previous_ema(tmp_path, sequence)
    agents, logs = _two_nodes(["accumulate", str(live), "--decay", "0.95", "--out", str(out)], tmp_path)
    stopped = [agents[1].pid]
    try:
        _wait_for_staging(out, agents)
        stopped += _children(agents[1].pid)
        for pid in stopped:  # a node frozen: its sockets stay open, nothing answers
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        survivors = _children(agents[0].pid)
        code = agents[0].wait(timeout=BOUND + 60)
        waited = time.monotonic() - started
    finally:
        _kill_all(stopped)
    text = logs[0].read_text()
    assert code != 0 and waited < BOUND, (waited, text[-3000:])
    errors = _one_error_line(text)
    assert len(errors) == 1 and ("has not answered for" in errors[0] or "lost the workers' store" in errors[0]), text
    assert not [pid for pid in survivors if _alive(pid)]  # no worker left behind on the surviving node
    assert _tree(out) == before  # the previous EMA is intact
    from ema_ckpt.commands.accumulate import accumulate

    accumulate(live, decay=0.95, out=out)  # the next run finishes the job and clears the staging
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


LONG_STEP = Path(__file__).with_name("workers_long_step.py")


def _kill_an_agent_mid_step(tmp_path: Path, killed: int) -> tuple[int, float, list[int], list[str]]:
    """Two agents (node a hosts the rendezvous) run a long step; once both workers have joined,
    agent ``killed`` alone is SIGKILLed (its worker orphaned). Returns the survivor's exit code,
    how long it took to exit, the workers still alive after the bound, and both nodes' logs."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    agents = []
    for i, log in enumerate(logs):
        cmd = _agent_command(endpoint, run_id, [], host=i == 0)
        cmd = [*cmd[: cmd.index("-m", 3)], str(LONG_STEP), "600"]
        agents.append(_start(cmd, log, _env()))
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while sum(log.read_text().count("joined as worker") for log in logs) < 2:
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents)
            time.sleep(0.05)
        workers = _children(agents[0].pid) + _children(agents[1].pid)
        os.kill(agents[killed].pid, signal.SIGKILL)
        started = time.monotonic()
        code = agents[1 - killed].wait(timeout=BOUND + 60)
        waited = time.monotonic() - started
        while [pid for pid in workers if _alive(pid)] and time.monotonic() - started < BOUND:
            time.sleep(0.1)
        left = [pid for pid in workers if _alive(pid)]
    finally:
        _kill_all(workers)
    return code, waited, left, [log.read_text() for log in logs]


def test_a_killed_launcher_leaves_no_worker_behind(tmp_path):
    """torchrun killed on one node (its workers orphaned) mid-step: they stop at once, the other
    node's worker ends within the bound."""
    code, waited, left, (survivor, orphaned) = _kill_an_agent_mid_step(tmp_path, killed=1)
    assert code != 0 and waited < BOUND, (waited, survivor[-3000:])
    assert not left, "a worker outlived its launcher"
    assert "its launcher" in orphaned and "is gone" in orphaned
    errors = _one_error_line(survivor)
    assert len(errors) == 1 and "worker" in errors[0], survivor[-3000:]
    assert "done" not in survivor


def test_a_killed_launcher_that_hosts_the_rendezvous_leaves_no_worker_behind(tmp_path):
    """torchrun killed on the node hosting the rendezvous store: the other node's torchrun loses
    its store and ends (with torchrun's own report), and no worker on either node is left."""
    code, waited, left, (orphaned, survivor) = _kill_an_agent_mid_step(tmp_path, killed=0)
    assert code != 0 and waited < BOUND, (waited, survivor[-3000:])
    assert not left, "a worker outlived its launcher"
    assert "its launcher" in orphaned and "is gone" in orphaned
    assert "done" not in survivor


def test_a_node_that_never_comes_ends_at_the_rendezvous_deadline(sequence, tmp_path):
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    cmd = _agent_command(endpoint, run_id, ["accumulate", str(sequence), "--decay", "0.9", "--out",
                                            str(tmp_path / "ema")], rdzv_conf="join_timeout=5")
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode != 0 and time.monotonic() - started < 60
    assert "RendezvousTimeoutError" in proc.stderr
    assert not (tmp_path / "ema").exists()


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"emack{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: 10.77.x.1 and 10.77.x.2 (made and removed here)."""
    if not _can_make_namespaces():
        pytest.skip("needs root and `ip netns`")
    tag = uuid.uuid4().hex[:6]
    names, links = [f"ema{tag}a", f"ema{tag}b"], [f"va{tag}", f"vb{tag}"]
    subnet = f"10.77.{int(tag[:2], 16)}"
    addresses = [f"{subnet}.1", f"{subnet}.2"]

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        for name in names:
            ip("netns", "add", name)
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, addresses, strict=True):
            ip("link", "set", link, "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", name, "link", "set", link, "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield names, links, addresses
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def _in_namespaces(args: list[str], tmp_path: Path, names: list[str], links: list[str],
                   addresses: list[str]) -> tuple[list[subprocess.Popen], list[Path]]:
    endpoint, run_id = f"{addresses[0]}:29517", uuid.uuid4().hex[:8]
    agents, logs = [], []
    for i, (name, link, address) in enumerate(zip(names, links, addresses, strict=True)):
        logs.append(tmp_path / f"host-{i}.log")
        conf = f"join_timeout=60,read_timeout=20,is_host={1 if i == 0 else 0}"
        cmd = _agent_command(endpoint, run_id, args, rdzv_conf=conf, local_addr=address)
        agents.append(_start(cmd, logs[-1], _env(GLOO_SOCKET_IFNAME=link), prefix=["ip", "netns", "exec", name]))
        time.sleep(0.5)
    return agents, logs


def test_two_hosts_write_the_bytes_of_one_worker_and_survive_a_cut(two_hosts, sequence, tmp_path):
    from ema_ckpt.commands.accumulate import accumulate

    names, links, addresses = two_hosts
    accumulate(sequence, decay=0.95, out=tmp_path / "single")
    agents, logs = _in_namespaces(["accumulate", str(sequence), "--decay", "0.95", "--out",
                                   str(tmp_path / "hosts")], tmp_path, names, links, addresses)
    for agent, log in zip(agents, logs, strict=True):
        assert agent.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert _tree(tmp_path / "single") == _tree(tmp_path / "hosts")

    # the cable cut mid-run: no FIN, no RST, only silence
    live, out, before = _previous_ema(tmp_path, sequence)
    agents, logs = _in_namespaces(["accumulate", str(live), "--decay", "0.95", "--out", str(out)], tmp_path,
                                  names, links, addresses)
    workers: list[int] = []
    try:
        _wait_for_staging(out, agents)
        workers = _children(agents[0].pid) + _children(agents[1].pid)
        subprocess.run(["ip", "-n", names[1], "link", "set", links[1], "down"], check=True)
        started = time.monotonic()
        while [pid for pid in workers if _alive(pid)] and time.monotonic() - started < BOUND + 30:
            time.sleep(0.1)
        waited = time.monotonic() - started
        left = [pid for pid in workers if _alive(pid)]
    finally:
        # torchrun's agent on the far side of the cut can wait minutes on its own store calls:
        # the agents are not ema-ckpt's processes, and are not waited for
        _kill_all([*workers, *(a.pid for a in agents)])
    assert not left and waited < BOUND + 30, (waited, [log.read_text()[-2000:] for log in logs])
    for log in logs:  # each side says what it lost, in one line
        errors = _one_error_line(log.read_text())
        assert len(errors) == 1 and ("has not answered" in errors[0] or "lost the workers' store" in errors[0]), \
            log.read_text()[-3000:]
    assert _tree(out) == before
