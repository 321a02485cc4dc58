"""The framework examples trained as islands that are separate jobs (issue #35): `islands run --separate-jobs` starts
2 islands of 2 gloo workers, each island its own job whose framework (Hugging Face Trainer, Lightning, accelerate)
runs DDP over its own default group, and the outer strategy (DiLoCo) runs across them through the callback.

Each example prints one RESULT line per worker: its losses, the bytes it sent across islands, its rounds and a digest
of its model after the final synchronisation. The tests read them: every worker of every island ends with the same
global model, bytes went across, the loss fell. A fault test kills one island mid-run: the other finishes alone; a
restart test kills one and starts it again (resuming its own checkpoint under HF and Lightning): it rejoins; with the
store hosted by `islands cross-store`, island 0's death leaves island 1 its store. bf16 mixed precision with gradient
accumulation runs through both callbacks with an ISLANDS_TOKEN.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.cli import islands_cli as cli
from islands.runtime.cross import CrossSpec
from islands.runtime.launch import spawn
from islands.runtime.payload_auth import TAG

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
HERE = Path(__file__).resolve().parent
# one xdist process runs them all (`make test`: --dist loadgroup), so that one fork server preloads the frameworks
# for every test here (harness: the launcher's script servers live as long as the process); spread over three
# processes, each started its own (~7 CPU-s each)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_frameworks")]
# what the scripts import, imported once by the launcher's fork server (`islands run --preload`): each rank is then a
# copy instead of an interpreter importing transformers' Trainer (~5 CPU-s) or Lightning (~5.5 CPU-s) itself; the
# refusal test below starts fresh interpreters, the default
PRELOAD = ",".join(
    [
        "transformers.trainer",
        "transformers.models.gpt2.modeling_gpt2",
        "lightning.pytorch",
        "accelerate",
        "islands.integrations.transformers",
        "islands.integrations.lightning",
    ]
)


def separate_jobs(
    script: Path, cwd: Path, monkeypatch, capfd, *, expect: int = 0, extra=(), workers: int = 4, **env
) -> list[dict]:
    """`islands run --workers WORKERS --islands 2 --separate-jobs SCRIPT` from this process in `cwd`; every worker's
    RESULT line (the islands' rank 0 print to stdout, the others to their logs)."""
    monkeypatch.chdir(cwd)
    for key, value in {"OMP_NUM_THREADS": "1", "STEPS": "40", "INNER_STEPS": "10", **env}.items():
        monkeypatch.setenv(key, value)
    capfd.readouterr()
    run_dir = cwd / "runs" / f"job{len(list(cwd.glob('runs/job*')))}"
    argv = ["run", "--workers", str(workers), "--islands", "2", "--separate-jobs", "--run-dir", str(run_dir)]
    argv += ["--preload", PRELOAD, *extra]
    code = cli(*argv, str(script), timeout=600)
    out = capfd.readouterr()
    logs = "".join(p.read_text() for p in sorted(run_dir.glob("logs/*/*.log")))
    assert code == expect, out.out[-2000:] + out.err[-3000:] + logs[-4000:]
    text = out.out + logs
    if "ISLANDS_TOKEN" not in env:  # the launcher made the islands a token of their own
        assert (run_dir / "token").stat().st_mode & 0o777 == 0o600
    return [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line]


def check_islands(results: list[dict], rounds: int) -> None:
    """Two islands of two workers, one global model, DiLoCo's rounds and bytes, and a falling loss on each."""
    assert sorted((r["island"], r["local_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["islands"] for r in results} == {2}
    assert len({r["digest"] for r in results}) == 1, [r["digest"] for r in results]
    assert {r["rounds"] for r in results} == {rounds}
    assert min(r["cross_bytes"] for r in results) > 0
    # DDP inside each island: its two workers hold the same model, so they send the same bytes across
    assert len({r["cross_bytes"] for r in results}) == 1
    for r in results:
        first, last = r["losses"][:3], r["losses"][-3:]
        assert sum(last) / len(last) < 0.9 * sum(first) / len(first), r["losses"]
    # the islands drew different data (their losses differ), though each island's workers agree on the model
    by_island = {r["island"]: r["losses"] for r in results if r["local_rank"] == 0}
    assert by_island[0] != by_island[1]


def test_hf_trainer_callback_two_islands_then_resumed(tmp_path, monkeypatch, capfd):
    out = tmp_path / "out"
    results = separate_jobs(
        EXAMPLES / "hf_trainer.py", tmp_path, monkeypatch, capfd, STEPS="20", SAVE_STEPS="20", OUT_DIR=str(out)
    )
    check_islands(results, rounds=2)
    for i in range(2):  # the callback wrote its outer state beside each island's checkpoint
        assert sorted(p.name for p in (out / f"island{i}" / "checkpoint-20").glob("islands-outer-*")) == [
            "islands-outer-0.pt",
            "islands-outer-1.pt",
        ]
    # resumed to 40 steps: the outer rounds continue from the checkpoint's 2 (a fresh start would count 2, not 4);
    # as islands of one worker (each loads its rank's outer state; ~12 s of CPU less than 4 fresh framework processes)
    resumed = separate_jobs(
        EXAMPLES / "hf_trainer.py", tmp_path, monkeypatch, capfd, workers=2, STEPS="40", RESUME="1", OUT_DIR=str(out)
    )
    assert {r["rounds"] for r in resumed} == {4}
    assert len({r["digest"] for r in resumed}) == 1
    # trainer.save_model wrote the global model: the same weights in both islands' folders
    saved = [load_file(out / f"island{i}" / "model.safetensors") for i in range(2)]
    assert saved[0].keys() == saved[1].keys()
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


def test_lightning_callback_two_islands_then_resumed(tmp_path, monkeypatch, capfd):
    ckpt = tmp_path / "ckpt"
    results = separate_jobs(
        EXAMPLES / "lightning_module.py", tmp_path, monkeypatch, capfd, STEPS="20", CHECKPOINT=str(ckpt)
    )
    check_islands(results, rounds=2)
    # resumed from Lightning's own checkpoint to 40 steps: the outer rounds continue from the saved 2 (as islands of
    # one worker, as above)
    resumed = separate_jobs(
        EXAMPLES / "lightning_module.py", tmp_path, monkeypatch, capfd, workers=2, STEPS="40", CHECKPOINT=str(ckpt)
    )
    assert {r["rounds"] for r in resumed} == {4}
    assert {len(r["losses"]) for r in resumed} == {20}  # only the steps after the checkpoint ran
    assert len({r["digest"] for r in resumed}) == 1


def test_accelerate_loop_two_islands(tmp_path, monkeypatch, capfd):
    results = separate_jobs(EXAMPLES / "accelerate_loop.py", tmp_path, monkeypatch, capfd, STEPS="60")
    check_islands(results, rounds=6)
    assert min(r["accuracy"] for r in results) > 0.5


@pytest.mark.parametrize("script", ["precision_hf.py", "precision_lightning.py"])
def test_mixed_precision_and_accumulation(tmp_path, monkeypatch, capfd, script):
    """bf16 mixed precision (CPU autocast: HF `bf16=True, use_cpu=True`, Lightning `precision="bf16-mixed"`) with 2
    micro-batches per optimizer step, 2 islands of 1 worker (processes: each island is a job of its own). The forward
    ran in bf16 while the parameters, DiLoCo's global model and its exchange stayed fp32 (4 bytes per parameter per
    round); H counts optimizer steps (20 steps of 2 micro-batches, H=5: 4 rounds, not 8); after every round and at the
    end both islands hold the same model; the loss fell."""
    # with ISLANDS_TOKEN: the islands meet over the signed cross store and tag their payloads (runtime.cross)
    env = {"STEPS": "20", "INNER_STEPS": "5", "ACCUM": "2", "ISLANDS_TOKEN": "precision-test"}
    results = separate_jobs(HERE / script, tmp_path, monkeypatch, capfd, workers=2, **env)
    assert sorted(r["island"] for r in results) == [0, 1]
    for r in results:
        assert r["computed_in"] == ["torch.bfloat16"]
        assert r["param_dtypes"] == r["global_dtypes"] == ["torch.float32"]
        assert r["forwards"] == 40 and r["optimizer_steps"] == 20
        assert r["rounds"] == 4 and [step for step, _ in r["round_digests"]] == [5, 10, 15, 20]
        # fp32 deltas, the master parameters' own, each with its HMAC tag (the token)
        assert r["outer_bytes"] == r["rounds"] * (r["numel"] * 4 + TAG)
        first, last = r["losses"][:8], r["losses"][-8:]
        assert sum(last) < 0.7 * sum(first), r["losses"]
    assert results[0]["round_digests"] == results[1]["round_digests"]
    assert results[0]["digest"] == results[1]["digest"]
    assert results[0]["losses"] != results[1]["losses"]  # the islands drew different batches


def test_hf_trainer_with_fsdp_inside_each_island(tmp_path, monkeypatch, capfd):
    """The Hugging Face Trainer with `fsdp="full_shard"` and FSDP2, 2 islands x 2 workers, DiLoCo (H=5) through the
    callback, on CPU gloo: accelerate's FSDP branch forced as a GPU job's state would choose it (fsdp_hf.py's
    stand-in; without it accelerate wraps the model in DDP). Inside each island the parameters are FSDP2's DTensors;
    each worker sends across only its own shard (its shard's bytes, not the model's, per round, plus the token's
    tag), the two shards of an island make up the model; all four workers end with one full model, and the model
    trainer.save_model wrote in each island's folder is that one. Then resumed from the checkpoint of step 20 (FSDP's
    own, with the callback's per-worker outer state of DTensor shards beside it) to step 40: the rounds go on from 4."""
    out = tmp_path / "out"
    env = {"INNER_STEPS": "5", "OUT_DIR": str(out), "ISLANDS_TOKEN": "fsdp-test", "SAVE_STEPS": "20"}
    results = separate_jobs(HERE / "fsdp_hf.py", tmp_path, monkeypatch, capfd, STEPS="20", **env)
    assert sorted((r["island"], r["local_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    numel = results[0]["numel"]
    for r in results:
        # accelerate by itself keeps a CPU job MULTI_CPU (when this fails, a later accelerate shards on CPU: drop
        # the stand-in in fsdp_hf.py and say so in docs/frameworks.md)
        assert r["accelerate_chose"] == "DistributedType.MULTI_CPU"
        assert r["distributed_type"] == "DistributedType.FSDP" and r["param_types"] == ["DTensor"]
        assert r["rounds"] == 4
        assert 0 < r["shard_numel"] < numel
        assert r["outer_bytes"] == r["rounds"] * (r["shard_numel"] * 4 + TAG)  # fp32 shard deltas, tagged
        first, last = r["losses"][:3], r["losses"][-3:]
        assert sum(last) < 0.9 * sum(first), r["losses"]
    for island in (0, 1):
        assert sum(r["shard_numel"] for r in results if r["island"] == island) == numel
    assert len({r["digest"] for r in results}) == 1, [r["digest"] for r in results]
    for island in (0, 1):
        saved = load_file(out / f"island{island}" / "model.safetensors")
        h = hashlib.sha256()
        for name in sorted(saved):
            h.update(name.encode() + saved[name].contiguous().numpy().tobytes())
        assert h.hexdigest()[:16] == results[0]["digest"], island
    resumed = separate_jobs(HERE / "fsdp_hf.py", tmp_path, monkeypatch, capfd, STEPS="40", RESUME="1", **env)
    assert len(resumed) == 4 and {r["rounds"] for r in resumed} == {8}  # a fresh start would count 4, not 8
    assert {len(r["losses"]) for r in resumed} == {20}  # only the steps after the checkpoint ran
    assert {r["param_types"][0] for r in resumed} == {"DTensor"} and len({r["digest"] for r in resumed}) == 1


def test_an_island_that_dies_leaves_the_other_training(tmp_path, monkeypatch, capfd):
    """Island 1's job dies at step 25 of 60 (DiLoCo every 10): the launcher stops that island alone and exits 1;
    island 0's cross group drops it (heartbeat gone) and island 0 finishes every step alone."""
    results = separate_jobs(
        HERE / "island_dies.py",
        tmp_path,
        monkeypatch,
        capfd,
        expect=1,
        extra=["--timeout", "30", "--heartbeat-timeout", "6"],  # 2 s was missed by a loaded start-up
        DIE_AT="25",
    )
    assert sorted((r["island"], r["local_rank"]) for r in results) == [(0, 0), (0, 1)]
    for r in results:
        assert r["steps"] == 60 and r["islands"] == 1
        # island 1 as it first entered: "island1", or "island1.1" when epoch 0 formed before it registered (a
        # heavily loaded machine, heartbeat timeout 6 s) and it came in as a late joiner
        assert [name.split(".")[0] for name in r["gone"]] == ["island1"], r["gone"]
        assert r["rounds"] == 6  # every round ran: two with island 1, four alone


def test_a_callback_in_one_job_of_several_islands_is_refused(tmp_path, monkeypatch, capfd):
    """`islands run --islands 2` without --separate-jobs: the Trainer's DDP would span both islands, so the
    callback refuses, naming the launch that works."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OUT_DIR", str(tmp_path / "out"))
    capfd.readouterr()
    run_dir = tmp_path / "runs" / "one-job"
    code = cli("run", "--workers", "2", "--islands", "2", "--run-dir", str(run_dir), str(EXAMPLES / "hf_trainer.py"))
    out = capfd.readouterr()
    text = out.out + out.err + "".join(p.read_text() for p in run_dir.glob("logs/*.log"))
    assert code == 1
    assert "every step would cross between islands" in text and "--separate-jobs" in text


class Island:
    """A process started with its output in files, read as subprocess.Popen.communicate reads pipes."""

    def __init__(self, proc, logs: list[Path]):
        self.proc, self.logs = proc, logs

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()

    def communicate(self, timeout: float) -> tuple[str, str]:
        self.proc.wait(timeout)
        out, err = (p.read_text() for p in self.logs)
        return out, err


@pytest.mark.parametrize(
    ("script", "workers"),
    [
        ("island_rejoins_hf.py", 1),
        ("island_rejoins_lightning.py", 1),
        ("island_rejoins.py", 2),
    ],
)
def test_a_restarted_island_rejoins(tmp_path, script, workers):
    """Two islands started directly as jobs of their own (ISLANDS_CROSS_*, island 0 hosting the store): a Hugging Face
    Trainer and a Lightning Trainer with IslandsCallback as one process each, and a plain loop with `attach` as a
    torchrun job of 2 workers per island (DDP inside; its one-worker form is the same path with less start-up).
    Island 1 is SIGKILLed at step 35 of 300 (DiLoCo every 10); island 0 drops it and trains on. Started again with
    the same settings (the framework scripts resuming from their own checkpoint of step 30), island 1 enters at
    island 0's next round boundary as `island1.1` (every worker at the same boundary) with island 0's global model,
    outer state and step, runs the remaining steps from there (the frameworks' step counters moved on past the
    checkpoint's), and all end with one global model. Processes: a SIGKILLed job and its restart are what is tested."""
    from harness.procs import free_port

    path = HERE / script
    address = f"127.0.0.1:{free_port()}"
    # with ISLANDS_TOKEN: a signed cross store, tagged payloads, and the restarted island's state transfer keyed by it
    base = {**os.environ, "OMP_NUM_THREADS": "1", "STEPS": "300", "ISLANDS_TOKEN": "rejoin-test"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(key, None)
    launch = [sys.executable] if workers == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += [] if workers == 1 else ["--nproc-per-node", str(workers)]

    started = 0

    def island(index: int, **env):
        """Island `index` as a process of its own: one framework process forked from a server that preloaded the
        frameworks (as `islands run --preload` starts them, so the restarted island skips their imports), or a
        torchrun job of fresh interpreters. Its stdout and stderr go to files (communicate() reads them)."""
        nonlocal started
        spec = CrossSpec(address, islands=2, index=index, timeout_s=60, heartbeat_timeout_s=5)
        started += 1
        logs = [tmp_path / f"island{index}-{started}.{kind}" for kind in ("out", "err")]
        env = {**base, **spec.env(), **env, **({spawn.PRELOAD_ENV: PRELOAD} if workers == 1 else {})}
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            return Island(spawn.start([*launch, str(path)], env, stdout=out, stderr=err, cwd=str(tmp_path)), logs)

    def results(proc: Island, what: str) -> list[dict]:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{what} exited {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert len(lines) == workers, out[-2000:] + err[-2000:]
        return [json.loads(line.split("RESULT ", 1)[1]) for line in lines]

    first = island(0, PACE_S="0.2")  # until it admits a joiner: room for a slow restart (island_rejoins.py)
    killed = island(1, DIE_AT="35")
    try:
        out, err = killed.communicate(timeout=300)
        assert out.count("STARTED island1 at 0") == workers, out[-2000:] + err[-2000:]  # members of the first epoch
        # SIGKILL: the job died without a word to the others (torchrun reports its workers' deaths as a failure)
        assert killed.returncode == (-9 if workers == 1 else 1), err[-2000:]
        framework = script != "island_rejoins.py"  # these checkpoint every 30 steps, and resume when restarted
        restarted = island(1, **({"RESUME": "1"} if framework else {}))
        joiners = results(restarted, "the restarted island 1")
        members = results(first, "island 0")
    finally:
        for proc in (first, killed):
            if proc.poll() is None:
                proc.kill()
    check_rejoined(members, joiners, lost_at=35)
    if framework:  # it resumed its own checkpoint of step 30, then the members' step replaced that one's
        assert {(joiner["loaded"], joiner["final_step"]) for joiner in joiners} == {(30, 300)}


def check_rejoined(members: list[dict], joiners: list[dict], lost_at: int) -> None:
    """The RESULT lines of island 0's workers (`members`) and of island 1's second incarnation (`joiners`) after
    island 1 was lost at step `lost_at` of 300 (DiLoCo every 10) and started again: island 0 ran every step, dropped
    `island1` and then admitted `island1.1`; all of its workers entered at one later round boundary with island 0's
    step and round count, took part in the exchanges from there, and every worker ends with one global model."""
    for member in members:
        assert member["name"] == "island0" and member["start"] == 0 and member["steps"] == 300
        kinds = [e["type"] for e in member["events"]]
        assert "failure" in kinds and "join" in kinds and kinds.index("failure") < kinds.index("join")
        assert next(e for e in member["events"] if e["type"] == "failure")["gone"] == ["island1"]
        assert next(e for e in member["events"] if e["type"] == "join")["joined"] == ["island1.1"]
    # every slot admitted island 1's worker at the same boundary (one verdict per round for all slots)
    joins = {next(e for e in m["events"] if e["type"] == "join")["step"] for m in members}
    assert len(joins) == 1
    join = joins.pop()
    for joiner in joiners:
        # the restarted island entered at that boundary: the members' step (a round boundary past the loss), from
        # which it ran the remaining steps, and their outer state (their round count)
        assert joiner["name"] == "island1.1" and [e["type"] for e in joiner["events"]] == ["entered"]
        assert joiner["start"] == join and lost_at < joiner["start"] < 300 and joiner["start"] % 10 == 0
        assert joiner["start"] + joiner["steps"] == 300
        assert joiner["rounds"] == members[0]["rounds"] == 30
        assert joiner["islands"] == members[0]["islands"] == 2
        # it took part in the exchanges after it entered
        assert joiner["outer_sent"] > 0, joiner["ledger"]
    # and every worker of both islands ends with the same global model
    assert len({r["digest"] for r in members + joiners}) == 1


def test_a_dropped_slow_island_is_restarted_by_torchrun_and_rejoins(tmp_path):
    """Each island a torchrun job of one worker (the plain loop with `attach`), ISLANDS_CROSS_TIMEOUT 6 s, island 1's
    job with `--max-restarts 1`. Island 1 stalls 20 s before step 15 (alive: its heartbeat beats on), so its exchange
    of step 20 comes after the timeout and island 0 drops it and trains on. At that exchange island 1 learns it was
    dropped: its worker prints one line that says why and what to do, no traceback, and exits 1; torchrun starts it
    again (TORCHELASTIC_RESTART_COUNT 1: no stall), and it rejoins as `island1.1` at a later round boundary with
    island 0's global model, as a restarted dead island does."""
    from harness.procs import free_port

    address = f"127.0.0.1:{free_port()}"
    base = {**os.environ, "OMP_NUM_THREADS": "1", "STEPS": "300", "ISLANDS_TOKEN": "slow-island-test"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        base.pop(key, None)

    def island(index: int, restarts: int, **env) -> Island:
        # both islands start the same way, so each is up well within the first epoch's wait (the 6 s timeout)
        spec = CrossSpec(address, islands=2, index=index, timeout_s=6, heartbeat_timeout_s=5)
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
        launch += ["--max-restarts", str(restarts), str(HERE / "island_rejoins.py")]
        logs = [tmp_path / f"island{index}.{kind}" for kind in ("out", "err")]
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            return Island(spawn.start(launch, {**base, **spec.env(), **env}, out, err, str(tmp_path)), logs)

    # island 0 waits for its next exchange 2 x 6 s (the exchange, then the epoch without island 1) before it goes
    # on alone: a 20 s stall outlasts both; PACE_S keeps island 0 training until the restarted island is in
    islands_ = [island(0, restarts=0, PACE_S="0.2"), island(1, restarts=1, STALL_AT="15", STALL_S="20")]
    try:
        (out1, err1), (out0, err0) = (isl.communicate(timeout=300) for isl in reversed(islands_))
    finally:
        for proc in islands_:
            if proc.poll() is None:
                proc.kill()
    assert islands_[0].returncode == 0, out0[-2000:] + err0[-4000:]
    assert islands_[1].returncode == 0, out1[-2000:] + err1[-4000:]  # its second incarnation finished
    # the first incarnation was in epoch 0, was dropped, and exited 1 with the one line; torchrun restarted it
    assert "STARTED island1 at 0" in out1 and "STARTED island1.1 at " in out1, out1[-2000:]
    dropped = [line for line in err1.splitlines() if line.startswith("islands: ")]
    assert len(dropped) == 1, err1[-4000:]
    assert dropped[0].startswith("islands: island1 was dropped by the other islands"), dropped
    assert "after ISLANDS_CROSS_TIMEOUT (6 s)" in dropped[0] and "same launch line" in dropped[0], dropped
    assert "Traceback" not in err1 and "(exitcode: 1)" in err1, err1[-4000:]  # torchrun's report of its exit
    [member] = [json.loads(line.split("RESULT ", 1)[1]) for line in out0.splitlines() if line.startswith("RESULT ")]
    [joiner] = [json.loads(line.split("RESULT ", 1)[1]) for line in out1.splitlines() if line.startswith("RESULT ")]
    check_rejoined([member], [joiner], lost_at=20)


def test_a_store_of_its_own_outlives_island_0(tmp_path):
    """`python -m islands cross-store --port 0` hosts the cross store as a process of its own, without a token; two
    islands (the plain loop with `attach`, one process each, ISLANDS_CROSS_HOST_STORE=0, ISLANDS_TOKEN set) meet
    through it. Island 0's job is SIGKILLed at step 25 of 60 (DiLoCo every 10): island 1 drops it and runs every
    step and round alone. With the default, island 0 hosting the store, its death would have taken the store with it.
    SIGTERM then ends the store's host: exit 0, no traceback."""
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ISLANDS_TOKEN"):
        base.pop(key, None)
    store_logs = [tmp_path / f"store.{kind}" for kind in ("out", "err")]
    with open(store_logs[0], "w") as out, open(store_logs[1], "w") as err:
        store = subprocess.Popen(
            [sys.executable, "-m", "islands", "cross-store", "--port", "0"],
            env=base,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    islands_: list[Island] = []
    try:
        deadline = time.monotonic() + 120
        while not (
            said := re.search(r"ISLANDS_CROSS_ADDR=(\S+) ISLANDS_CROSS_HOST_STORE=0", store_logs[0].read_text())
        ):
            assert store.poll() is None and time.monotonic() < deadline, store_logs[1].read_text()[-2000:]
            time.sleep(0.1)
        address = said.group(1)
        for index in range(2):
            spec = CrossSpec(address, islands=2, index=index, host_store=False, timeout_s=60, heartbeat_timeout_s=5)
            env = {**base, **spec.env(), "ISLANDS_TOKEN": "cross-store-test", "STEPS": "60"}
            env.update({"DIE_AT": "25"} if index == 0 else {})
            logs = [tmp_path / f"island{index}.{kind}" for kind in ("out", "err")]
            with open(logs[0], "w") as out, open(logs[1], "w") as err:
                proc = spawn.start([sys.executable, str(HERE / "island_rejoins.py")], env, out, err, str(tmp_path))
            islands_.append(Island(proc, logs))
        out, err = islands_[1].communicate(timeout=300)
        killed_out, killed_err = islands_[0].communicate(timeout=60)
        assert islands_[1].returncode == 0, out[-2000:] + err[-4000:]
        assert "STARTED island0 at 0" in killed_out and islands_[0].returncode == -9, killed_err[-2000:]
        assert store.poll() is None, store_logs[1].read_text()  # the store's host outlived island 0 and the job
        store.terminate()
        assert store.wait(30) == 0
    finally:
        for proc in [*islands_, store]:
            if proc.poll() is None:
                proc.kill()
    stopped = store_logs[1].read_text()
    assert "stopped (SIGTERM)" in stopped and "Traceback" not in stopped, stopped
    [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
    survivor = json.loads(line.split("RESULT ", 1)[1])
    assert survivor["name"] == "island1" and survivor["start"] == 0 and survivor["steps"] == 60
    assert survivor["rounds"] == 6 and survivor["islands"] == 1  # every round ran: two with island 0, four alone
    assert [(e["type"], e.get("gone")) for e in survivor["events"]] == [("failure", ["island0"])]


def test_a_payload_that_fails_its_mac_ends_the_island_with_one_line(tmp_path):
    """Two islands (the plain loop with `attach`, one process each, ISLANDS_TOKEN set); from step 15 island 0's
    payloads are altered after they were tagged, as a box on the path between the islands would. At the exchange of
    step 20 island 1's check refuses island 0's delta: island 1 prints one line that says what failed and what to
    check, no traceback, and exits 1 (as a dropped island does, so torchrun --max-restarts would start it again).
    Island 0 (which hosts the cross store), whose own check passed, finds the operation failed, drops island 1 and
    trains on alone."""
    from harness.procs import free_port

    address = f"127.0.0.1:{free_port()}"
    base = {**os.environ, "OMP_NUM_THREADS": "1", "STEPS": "40", "ISLANDS_TOKEN": "payload-test"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        base.pop(key, None)
    islands_: list[Island] = []
    try:
        for index in range(2):
            spec = CrossSpec(address, islands=2, index=index, timeout_s=60, heartbeat_timeout_s=5)
            env = {**base, **spec.env(), **({"TAMPER_AT": "15"} if index == 0 else {})}
            logs = [tmp_path / f"island{index}.{kind}" for kind in ("out", "err")]
            with open(logs[0], "w") as out, open(logs[1], "w") as err:
                proc = spawn.start([sys.executable, str(HERE / "island_rejoins.py")], env, out, err, str(tmp_path))
            islands_.append(Island(proc, logs))
        out1, err1 = islands_[1].communicate(timeout=300)
        out0, err0 = islands_[0].communicate(timeout=300)
    finally:
        for proc in islands_:
            if proc.poll() is None:
                proc.kill()
    assert islands_[1].returncode == 1, out1[-2000:] + err1[-4000:]
    assert "Traceback" not in err1, err1[-4000:]
    [line] = [line for line in err1.splitlines() if line.startswith("islands: ")]
    assert "payload from member island0" in line and "failed its MAC" in line, line
    assert "ISLANDS_TOKEN" in line and "same launch line" in line, line  # what would be right, and how it comes back
    assert "RESULT " not in out1  # it stopped at the refused exchange
    assert islands_[0].returncode == 0, out0[-2000:] + err0[-4000:]
    [result] = [json.loads(x.split("RESULT ", 1)[1]) for x in out0.splitlines() if x.startswith("RESULT ")]
    assert result["name"] == "island0" and result["steps"] == 40 and result["islands"] == 1
    assert [(e["type"], e.get("gone")) for e in result["events"]] == [("failure", ["island1"])]
