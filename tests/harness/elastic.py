"""What the elastic-job tests share: starting `islands run --elastic` jobs and `islands join` workers as processes of
their own, waiting on files and store keys with a message that says what the job was doing, reading the records
the workers wrote, and a gated digits task for `islands train --elastic` jobs.

Gates, not long runs: a test that must act mid-run (kill a worker, admit a joiner) holds the job at a known step
until the other side is ready, instead of running thousands of steps to outlast a slow process start on a loaded
machine. Scripts write OUT/gate-NAME at their gate and wait there for OUT/go; the gated task below makes every
training forward wait while a HOLD file exists."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed import DistNetworkError

from harness.flags import ISLANDS_TRAIN, flags
from islands.runtime.elastic.membership import connect, parse_address

SRC = str(Path(__file__).resolve().parents[2] / "src")


def env() -> dict:
    """A worker's environment: islands importable, one thread, no token inherited from the caller."""
    e = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    e.pop("ISLANDS_TOKEN", None)
    return e


def wait(cond, what: str, timeout: float = 240.0, proc: subprocess.Popen | None = None, log=None, poll: float = 0.05):
    """Poll `cond` until it returns something true, and return that. Fails when `timeout` passes or `proc` (the
    job's launcher) ends first; `log` (a Path, or a callable returning text) is quoted in the failure."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = cond()
        except DistNetworkError:  # the job's store went away: the job ended; say why
            if proc is None:
                raise
            proc.wait(timeout=60)
            raise AssertionError(f"the job ended while waiting for {what}:\n{_text(log)}") from None
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the job ended while waiting for {what}:\n{_text(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{_text(log)}")
        time.sleep(poll)


def _text(log) -> str:
    if log is None:
        return ""
    if callable(log):
        return log()
    return log.read_text()[-4000:] if Path(log).exists() else ""


def store(address: str):
    """A plain client of the job's store (reads of keys such as round/R/join and ready/NAME)."""
    return connect(*parse_address(address))


def has_key(address: str, key: str):
    """A condition for `wait`: the job's store holds `key`."""
    client = store(address)
    return lambda: client.check([key])


def at_gate(out: Path, names) -> Callable[[], bool]:
    """A condition for `wait`: every named worker wrote OUT/gate-NAME."""
    return lambda: all((out / f"gate-{n}").exists() for n in names)


def train_over_store(store_url: str, run: Path, cwd: Path) -> subprocess.CompletedProcess:
    """`islands train` of a small elastic job (2 one-worker islands, digits, DiLoCo H=3, 9 steps) whose store is
    the etcd cluster at `store_url`; the cluster's client variables come from this process's environment."""
    return subprocess.run(
        [
            *ISLANDS_TRAIN,
            *flags(task="digits", workers=2, islands=2, outer="diloco:inner_steps=3", elastic=True, store=store_url),
            *flags(steps=9, global_batch=16, eval_every=0, no_probe=True, no_progress=True, heartbeat_timeout=5),
            *flags(run_dir=run),
        ],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def logs(run: Path) -> str:
    """The tail of every worker's and the job host's log (for failure messages)."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run / "logs").glob("*.log")))


def records(run_dir: Path) -> dict[str, dict]:
    """The members' records of an `islands train --elastic` run (RUN_DIR/elastic/NAME.json)."""
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "elastic").glob("*.json") if p.stem != "restarts"}


def outputs(out: Path, names) -> dict[str, dict]:
    """The records a script job's workers wrote (OUT/NAME.json)."""
    return {n: json.loads((out / f"{n}.json").read_text()) for n in names}


def start_job(
    tmp_path: Path,
    script: str,
    workers: int,
    *args: str,
    heartbeat: float = 5.0,
    timeout: float = 60.0,
    store_url: str = "",
    launcher_args: tuple[str, ...] = (),
    preload: str = "islands",
) -> tuple[subprocess.Popen, Path]:
    """`islands run --elastic` of `script` (written to tmp_path/job.py) from tmp_path, run directory tmp_path/run;
    the launcher's stderr goes to tmp_path/launcher.err (returned with the process). `launcher_args`: more flags
    of `islands run` (before the script). `preload`: its --preload (default "islands": the workers fork from the
    server that started the job host, ~2-3 CPU-s less each than a fresh interpreter; "": fresh interpreters)."""
    (tmp_path / "job.py").write_text(script)
    err = tmp_path / "launcher.err"
    with open(err, "w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "islands",
                "run",
                "--elastic",
                "--workers",
                str(workers),
                *(["--store", store_url] if store_url else []),
                "--heartbeat-timeout",
                str(heartbeat),
                "--timeout",
                str(timeout),
                *launcher_args,
                *(["--preload", preload] if preload else []),
                "--run-dir",
                "run",
                "job.py",
                *args,
            ],
            cwd=tmp_path,
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    return proc, err


def address(err: Path) -> str | None:
    """The job's address, once the launcher has printed it."""
    return next(
        (
            line.split("elastic job at ")[1].split(";")[0]
            for line in err.read_text().splitlines()
            if "elastic job at " in line
        ),
        None,
    )


def join(where: str, *token_args: str, name: str, cwd: Path) -> subprocess.Popen:
    """`islands join WHERE TOKEN-ARGS --name NAME` from `cwd` (WHERE: the job's address), its output (stdout and
    stderr) on one pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "islands", "join", where, *token_args, "--name", name],
        cwd=cwd,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, err: Path, timeout: float = 240.0) -> str:
    """Wait for the launcher (killed if it overruns); its stderr."""
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err.read_text()


def job_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line names `marker` (a test's directory: its workers and job host)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            pids.append(int(p.name))
    return pids


def worker_pid(run: Path, name: str) -> int:
    """The pid of the elastic worker `name` of a run: the process whose stdout is RUN_DIR/logs/<name>.log
    (forked from the launcher's fork server, its environment is the server's, so that does not name it)."""
    log = str(Path(run).resolve() / "logs" / f"{name}.log")
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and os.readlink(p / "fd" / "1") == log:
                return int(p.name)
        except OSError:
            continue
    raise LookupError(f"no live process writes {log}")


def kill_job_processes(marker: str) -> None:
    """SIGKILL what is left of a job (never leave a process behind, even when the test failed)."""
    for pid in job_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A task for `islands train --elastic` jobs: islands' digits task whose model waits, at every training forward,
# while the file named by the task option "hold" exists (and writes HOLD.<pid> once it waits there). The test
# holds the members at work until a joiner or a restarted worker is ready, instead of running thousands of steps;
# computation is unchanged, only time passes.
# With the task option model=bn-cnn the model is a BatchNorm CNN of the test's own instead of islands' MLP (its
# running statistics and num_batches_tracked are state every island must agree on bit for bit).
GATED_DIGITS = r"""
import os, time
import torch
import torch.nn as nn
from islands.tasks import digits_task

def _after(hold):  # HOLD's text: the training forwards a worker runs before the gate holds it (empty: none)
    try:
        return int(open(hold).read().strip() or 0)
    except (OSError, ValueError):
        return 0

class Gate(nn.Module):
    def __init__(self, inner, hold):
        super().__init__()
        self.inner, self.hold, self.seen = inner, hold, 0
    def forward(self, x):
        self._gate()
        return self.inner(x)
    @torch.compiler.disable  # compiled jobs: the counter and file checks stay out of the graph (no recompile a step)
    def _gate(self):
        held = False
        self.seen += self.training
        while self.training and self.hold and os.path.exists(self.hold) and self.seen > _after(self.hold):
            if not held:  # HOLD.<pid>: this worker waits at the gate (not mid-exchange)
                held = True
                open(f"{self.hold}.{os.getpid()}", "w").close()
            time.sleep(0.02)

class BNCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Linear(6 * 64, 10)
    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x.view(-1, 1, 8, 8)))).flatten(1))

def make_task(cfg):
    task = digits_task(cfg.task.hidden, cfg.batch_per_worker, cfg.train.seed)
    model = task.model
    if cfg.task.options.get("model") == "bn-cnn":
        torch.manual_seed(cfg.train.seed)
        model = BNCNN()
    task.model = Gate(model, cfg.task.options.get("hold", ""))
    return task
"""


def wait_for_acked_pushes(store, island: int, n: int) -> None:
    """A ps job: wait until island `island`'s data shard has `n` acknowledged pushes (ps/clock/<island>)."""

    def acked() -> bool:
        return store.check([f"ps/clock/{island}"]) and json.loads(store.get(f"ps/clock/{island}"))["pushes"] >= n

    wait(acked, f"island {island}'s push {n} acknowledged")


def kill_served_island_at_its_gate(store, hold: Path, island: int, pid: int, restarted: str) -> dict:
    """A ps job (gated_digits): hold every island at its next forward (mid-round, not mid-push), SIGKILL island
    `island`'s process `pid` once it waits there, and wait until its restarted incarnation `restarted` (a worker name)
    has pulled the global model. Returns the island's ps/clock entry read at the kill (its acknowledged pushes)."""
    if not hold.exists():  # else a gate set at a step before the job: the island stops there
        hold.write_text("")
    wait(lambda: Path(f"{hold}.{pid}").exists(), f"island {island} at the gate")
    killed = json.loads(store.get(f"ps/clock/{island}"))
    os.kill(pid, signal.SIGKILL)
    # the others wait until the restarted island has pulled the model (they would finish alone otherwise)
    wait(lambda: store.check([f"ps/island/{restarted}"]), "the restarted island's pull")
    return killed


def gated_digits(tmp_path: Path) -> tuple[str, Path]:
    """Write the gated digits task; returns its task spec (PATH:make_task) and the HOLD file it watches (set the
    task option "hold" to it). While HOLD exists every worker waits at its next training forward; a number in it
    lets each worker process run that many training forwards first (a gate at a fixed step, set before the job
    starts, which no observer can be too slow to catch)."""
    path = tmp_path / "gated_digits.py"
    path.write_text(GATED_DIGITS)
    return f"{path}:make_task", tmp_path / "HOLD"


def assert_nothing_half_written(run_dir: Path) -> None:
    """What an event left on disk is whole: no temporary file of an atomic write is left over, every JSON record
    parses, and every committed checkpoint verifies (all its parts there, every checksum right)."""
    from islands.checkpoint.store.directory import CheckpointStore

    run_dir = Path(run_dir)
    leftovers = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if ".tmp" in p.name]
    assert not leftovers, f"half-written files left in {run_dir}: {leftovers}"
    for path in run_dir.rglob("*.json"):
        try:
            json.loads(path.read_text())
        except ValueError as e:
            raise AssertionError(f"{path} is not whole JSON: {e}") from None
    ckpt = run_dir / "ckpt"
    if ckpt.is_dir() and any(ckpt.iterdir()):
        store = CheckpointStore(ckpt, clean=False)
        for step in store.steps():
            assert store.verify(step) == [], f"checkpoint step {step} in {ckpt} does not verify"


# What the elastic tests' jobs share: digits, no evaluation, no probe, no live bar, a 30 s collective timeout.
QUIET_ELASTIC = dict(task="digits", elastic=True, eval_every=0, probe=False, progress=False, timeout=30.0)


def elastic_config(**values):
    """A validated elastic job configuration: `values` (workers, islands, outer, steps, ...) over QUIET_ELASTIC."""
    from islands.app.validate import validate
    from islands.config import from_mapping

    return validate(from_mapping({**QUIET_ELASTIC, **values}))
