"""`islands run`: any script as N supervised ranks (and the same script under torchrun), and the interconnect
label the probe derives from how the ranks are really connected. The CLI runs in this process (_run) except where
the test signals the launcher itself."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import islands_cli
from islands.measure.probe import describe, is_loopback, local_address_towards, topology

ISLANDS_RUN = [sys.executable, "-m", "islands", "run"]
TIMEOUT = 120

# Joins with plain torch (no islands import), all-reduces, and records what it was given.
TINY = """
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.tensor([float(rank + 1)])
dist.all_reduce(x)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS",
        "PYTHONUNBUFFERED", "ISLANDS_ISLANDS")
out = Path(sys.argv[sys.argv.index("--out") + 1])
(out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "size": dist.get_world_size(), "sum": x.item(),
                                                  "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}))
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""

# Rank 1 fails (exit 3, or SIGKILL) while rank 0 sits in a barrier; rank 0 leaves its pid behind.
FAILING = """
import datetime, os, signal, sys, time
from pathlib import Path
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
out, how = Path(sys.argv[1]), sys.argv[2]
(out / f"pid{dist.get_rank()}").write_text(str(os.getpid()))
if dist.get_rank() == 1:
    time.sleep(0.5)
    print("rank 1: giving up on purpose", file=sys.stderr, flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
dist.barrier()  # never completes: rank 1 is gone
time.sleep(600)
"""

# No torch: ranks that just wait, for the launcher's own signals.
WAITING = """
import os, sys, time
from pathlib import Path
(Path(sys.argv[1]) / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(600)
"""


def _script(tmp_path: Path, text: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _run(capfd, *args: str) -> subprocess.CompletedProcess:
    """`islands run ARGS` with this process as the CLI (harness.cli.islands_cli): its launcher starts the ranks as
    from a shell, without one more interpreter importing torch to launch them; rank 0's stdout is the launcher's."""
    capfd.readouterr()
    code = islands_cli("run", *args, timeout=TIMEOUT)
    out = capfd.readouterr()
    return subprocess.CompletedProcess(["islands", "run", *args], code, out.out, out.err)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(out: Path, ranks: int) -> list[int]:
    return [int((out / f"pid{r}").read_text()) for r in range(ranks)]


def test_run_starts_ranks_that_join_all_reduce_and_get_their_arguments(tmp_path, capfd):
    script = _script(tmp_path, TINY)
    run = tmp_path / "run"
    done = _run(
        capfd,
        "--workers",
        "2",
        "--islands",
        "2",
        "--threads",
        "2",
        "--run-dir",
        str(run),
        str(script),
        "--flag",
        "x",
        "--workers",
        "7",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, rec in enumerate(ranks):
        assert rec["rank"] == r and rec["size"] == 2 and rec["sum"] == 3.0
        # everything after the script is the script's, flags the launcher also has included
        assert rec["argv"] == ["--flag", "x", "--workers", "7", "--out", str(tmp_path)]
        assert rec["env"] == {
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "2",
            "PYTHONUNBUFFERED": "1",
            "ISLANDS_ISLANDS": "2",
        }
    assert "rank 0 done" in done.stdout  # rank 0's stdout stays on the terminal
    assert "rank 1 done" in (run / "logs" / "rank1.log").read_text()


def test_one_worker_still_goes_through_the_launcher(tmp_path, capfd):
    script = _script(tmp_path, TINY)
    done = _run(capfd, "--workers", "1", "--run-dir", str(tmp_path / "run"), str(script), "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rec = json.loads((tmp_path / "rank0.json").read_text())
    assert rec["size"] == 1 and rec["env"]["ISLANDS_ISLANDS"] == "1"
    assert (tmp_path / "run" / "logs" / "rank0.log").exists()


@pytest.mark.parametrize("how, shown", [("exit", "exit code 3"), ("kill", "killed by SIGKILL")])
def test_a_failing_rank_ends_the_job_fast_and_its_log_tail_is_shown(tmp_path, how, shown, capfd):
    script = _script(tmp_path, FAILING)
    t = time.monotonic()
    done = _run(capfd, "--workers", "2", "--run-dir", str(tmp_path / "run"), str(script), str(tmp_path), how)
    assert done.returncode == 1
    assert time.monotonic() - t < 60  # rank 0's barrier would have waited 600 s
    assert f"worker rank 1 failed ({shown})" in done.stderr  # the rank that failed first, not its peer
    assert "rank 1: giving up on purpose" in done.stderr  # its log tail
    assert not any(_alive(pid) for pid in _pids(tmp_path, 2))  # rank 0 did not outlive the job


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stopping_the_launcher_stops_every_rank(tmp_path, sig, code):
    script = _script(tmp_path, WAITING)
    # SIGINT as a terminal gives it: a suite started in the background (`nohup make test &`) hands its
    # processes SIGINT ignored, and a launcher that inherits that rightly ignores Ctrl-C too
    job = subprocess.Popen(
        [*ISLANDS_RUN, "--workers", "2", "--run-dir", str(tmp_path / "run"), str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = _pids(tmp_path, 2)
        masks = [
            line
            for line in Path(f"/proc/{job.pid}/status").read_text().splitlines()
            if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
        ]  # what the launcher does with `sig`
        job.send_signal(sig)
        try:
            _, err = job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the launcher ignored {sig.name}; its signal masks then: {masks}") from None
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == code, err
    assert "stopping every rank" in err
    assert not any(_alive(pid) for pid in pids)


def test_a_missing_script_is_a_usage_error(tmp_path, capfd):
    done = _run(capfd, "--workers", "2", str(tmp_path / "nope.py"), "--flag")
    assert done.returncode == 2
    assert "nope.py' does not exist" in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_testbed_is_a_usage_error_before_any_rank_starts(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ISLANDS_TESTBED_DIR", str(tmp_path / "testbeds"))  # no testbeds known here
    script = _script(tmp_path, WAITING)
    done = _run(capfd, "--testbed", "nosuchbed", "--run-dir", str(tmp_path / "run"), str(script), str(tmp_path))
    assert done.returncode == 2
    assert "no testbed named 'nosuchbed'" in done.stderr and "islands testbed up --name nosuchbed" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


def test_a_busy_port_and_uneven_islands_are_usage_errors(tmp_path, capfd):
    script = _script(tmp_path, WAITING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = _run(capfd, "--port", str(s.getsockname()[1]), str(script), str(tmp_path))
    assert busy.returncode == 2 and "is busy" in busy.stderr
    uneven = _run(capfd, "--workers", "3", "--islands", "2", str(script), str(tmp_path))
    assert uneven.returncode == 2 and "must be divisible by islands (2)" in uneven.stderr
    assert not list(tmp_path.glob("pid*"))


def test_the_same_script_runs_under_torchrun(tmp_path):
    script = _script(tmp_path, TINY)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            "--flag",
            "x",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0] and ranks[1]["argv"] == ["--flag", "x", "--out", str(tmp_path)]


RESTARTED = """
import json, os, sys, time
import torch, torch.distributed as dist
import islands

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt > 0 and rank == 1:
    time.sleep(2)  # rank 0 reads the store first: a key left by the attempt before would give it a dead address
world = islands.init_world()
t = torch.ones(1)
dist.all_reduce(t)
if attempt < 2:
    os._exit(1)  # the attempt fails after its group formed: the agent restarts the worker group
sys.stdout.write("RESULT " + json.dumps({"rank": rank, "attempt": attempt, "sum": t.item()}) + "\\n")
sys.stdout.flush()
islands.close_world(world)
"""


def test_a_worker_group_that_torchrun_restarts_forms_its_group_again(tmp_path):
    """torchrun --max-restarts 2, 2 workers: the first two attempts form their group and fail; in each restarted one
    rank 1 comes up 2 s after rank 0. Every attempt meets in the agent's one store, where the keys of the attempt
    before remain: without a prefix of its own per attempt (init_default_group) rank 0 could read rank 1's dead
    address, and a restart failed ("connectFullMesh failed ... Connection refused") or hung, in about half of the
    restarts here; with it each restarted group forms, and the third attempt reduces."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
        + ["--monitor-interval", "0.2", str(_script(tmp_path, RESTARTED))],
        env={k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RESTART_COUNT"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {(r["attempt"], r["sum"]) for r in results} == {(2, 2.0)}


# ---- the interconnect label ------------------------------------------------------------------
def _rank(host="box", netns="net:[1]", addr="127.0.0.1") -> dict:
    return {"hostname": host, "netns": netns, "local_addr": addr, "socket_ifname": ""}


def _measured(topo: dict | None, **extra) -> dict:
    rec = {
        "measured": True,
        "backend": "gloo",
        "p2p": {"bandwidth_gbit_s": 0.1, "latency_us": 300},
        "all_reduce": [{"busbw_gb_s": 0.01}],
        **extra,
    }
    if topo is not None:
        rec["topology"] = topo
    return rec


def test_loopback_only_when_every_rank_reaches_the_master_over_loopback_on_one_host():
    one_box = topology("127.0.0.1", [_rank(), _rank()])
    assert one_box["hosts"] == 1 and one_box["loopback"]
    assert describe(_measured(one_box)).startswith("gloo loopback: p2p 0.10 Gbit/s")


def test_two_testbed_hosts_under_torchrun_are_a_network_not_loopback():
    # the defect: one machine, one hostname, but two network namespaces at 10.77.0.1 and 10.77.0.2
    two_ns = topology("10.77.0.1", [_rank(netns="net:[7]", addr="10.77.0.1"), _rank(netns="net:[8]", addr="10.77.0.2")])
    assert two_ns["hosts"] == 2 and not two_ns["loopback"]
    line = describe(_measured(two_ns))
    assert line.startswith("gloo network (2 hosts): ") and "loopback" not in line


def test_two_machines_and_one_machine_over_its_own_address():
    machines = topology(
        "node0",
        [_rank("node0", addr="192.168.1.10"), _rank("node0", addr="192.168.1.10"), _rank("node1", addr="192.168.1.11")],
    )
    assert machines["hosts"] == 2 and "gloo network (2 hosts)" in describe(_measured(machines))
    # MASTER_ADDR = this machine's LAN address: one host, but not a loopback address, so not called one
    own_ip = topology("192.168.1.10", [_rank(addr="192.168.1.10"), _rank(addr="192.168.1.10")])
    assert describe(_measured(own_ip)).startswith("gloo on one host (via 192.168.1.10)")
    # a loopback master but one rank in another namespace (unreachable in practice) is still not one host
    assert not topology("127.0.0.1", [_rank(), _rank(netns="net:[2]")])["loopback"]


def test_a_known_testbed_keeps_its_label_and_an_old_record_is_not_called_loopback():
    two_ns = topology("10.77.0.1", [_rank(netns="net:[7]", addr="10.77.0.1"), _rank(netns="net:[8]", addr="10.77.0.2")])
    assert describe(_measured(two_ns, testbed={"rate": "100mbit"})).startswith("testbed 100mbit: ")
    assert describe(_measured(None)).startswith("gloo, link not recorded: ")
    assert describe({"measured": False}) == "none (single process)"
    assert describe({"measured": False, "reason": "gloo, link not probed"}) == "gloo, link not probed"


def test_local_address_towards_sends_nothing_and_reports_the_route():
    assert local_address_towards("127.0.0.1") == "127.0.0.1" and is_loopback("127.0.0.1")
    assert local_address_towards("") is None
    assert local_address_towards("no-such-host.invalid") is None
    assert is_loopback("::1") and not is_loopback("10.77.0.2") and not is_loopback(None)


# os._exit: torch 2.13 with a device mesh over gloo sometimes aborts at interpreter exit ("terminate called
# without an active exception"), under torchrun too; the exit is not what these tests are about.
PROBING = """
import json, os, sys
from pathlib import Path
from islands.measure.probe import describe, probe_interconnect
from islands.runtime.world import close_world, init_world

world = init_world()
inter = probe_interconnect(world)
if world.rank == 0:
    Path(sys.argv[1]).write_text(json.dumps({"interconnect": inter, "line": describe(inter), "islands": world.islands}))
close_world(world)
os._exit(0)
"""


def test_the_probe_records_how_launched_ranks_are_connected(tmp_path, capfd):
    script = _script(tmp_path, PROBING)
    out = tmp_path / "probe.json"
    done = _run(capfd, "--workers", "2", "--islands", "2", "--run-dir", str(tmp_path / "run"), str(script), str(out))
    assert done.returncode == 0, done.stderr
    rec = json.loads(out.read_text())
    topo = rec["interconnect"]["topology"]
    assert rec["islands"] == 2  # init_world() took ISLANDS_ISLANDS
    assert topo["master_addr"] == "127.0.0.1" and topo["hosts"] == 1 and topo["loopback"]
    assert [r["local_addr"] for r in topo["ranks"]] == ["127.0.0.1", "127.0.0.1"]
    assert rec["line"].startswith("gloo loopback: ")


_MISSING = [t for t in ("ip", "tc") if not (shutil.which(t) or shutil.which(t, path="/usr/sbin:/sbin"))]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or bool(_MISSING), reason="needs root and iproute2 for a network testbed")
def test_ranks_on_two_testbed_hosts_are_a_network(tmp_path, monkeypatch, capfd):
    from islands import testbed
    from islands.testbed import lifecycle

    monkeypatch.setenv("ISLANDS_TESTBED_DIR", str(tmp_path / "testbeds"))
    name = "r" + secrets.token_hex(4)
    bed = testbed.up(name, 2, "1gbit")
    try:
        script = _script(tmp_path, PROBING)
        out = tmp_path / "probe.json"
        done = _run(
            capfd, "--workers", "2", "--testbed", name, "--run-dir", str(tmp_path / "run"), str(script), str(out)
        )
    finally:
        lifecycle.down(name)
    assert done.returncode == 0, done.stderr
    rec = json.loads(out.read_text())
    topo = rec["interconnect"]["topology"]
    assert topo["master_addr"] == bed.master_addr and topo["hosts"] == 2 and not topo["loopback"]
    assert [r["local_addr"] for r in topo["ranks"]] == [h.ip for h in bed.hosts]
    assert rec["line"].startswith("gloo network (2 hosts): ")
