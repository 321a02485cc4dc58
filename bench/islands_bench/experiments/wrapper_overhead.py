"""wrapper-overhead: what islands' wrappers cost against the tools they replace, on the same model in the same run.

1. islands' DDP (islands.inner.DDP: torch's DistributedDataParallel with islands' counted bucket hook)
   against torch's DDP with its built-in all-reduce: copies of the same model in the same pair of
   processes, their full steps (forward, backward with the all-reduce, AdamW) interleaved with the order
   rotating, a barrier before each; the median per arm, the max over ranks. A third copy runs torch's DDP
   with torch's own Python all-reduce hook: torch against torch, the noise floor the ratio is read
   against. Goal: at most 1.02x.
2. islands' DiLoCo against torchft's (torchft.local_sgd.DiLoCo with a Manager and a Lighthouse), two
   replicas of one worker each, the same model, data shards, H, inner AdamW and outer Nesterov SGD
   (lr 0.7, momentum 0.9, LIT-212), the run ending on a synchronisation: the global model's final
   validation loss, the bytes each replica sent, and the median time of an inner step and of a
   synchronising step. Goal: the same loss within noise, no more bytes, no more step time.
torchft's bytes are the payload of its all-reduce of one fp32 pseudo-gradient per round (torchft's
process group is not islands' counted Comm); islands' are its ledger.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from islands_bench.harness import BenchContext, experiment
from islands_bench.spawn import run_module_ranks

LIGHTHOUSE = """
import sys, time
from torchft._torchft import LighthouseServer
server = LighthouseServer(bind="[::]:0", min_replicas=int(sys.argv[1]))
print(server.address().rsplit(":", 1)[1], flush=True)
while True:
    time.sleep(3600)
"""


# ---- 1. DDP: islands' wrapper against torch's, interleaved in one process pair --------------------
def _ddp_worker(out_path: str, spec_json: str, rate: str) -> None:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    import islands
    from islands.measure import describe, probe_interconnect
    from islands_bench.experiments.user_models import loss_of, make
    from islands_bench.spawn import time_interleaved

    spec = json.loads(spec_json)
    torch.set_num_threads(1)
    world = islands.init_world()
    inter = probe_interconnect(world)
    arms = {}
    for arm in ("torch", "islands", "torch-python-hook"):
        model, batches, _, loss_fn = make(spec["model"], world.rank, world.size, spec["batch"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if arm == "islands":
            wrapped = islands.inner.DDP().wrap(model, opt, world)
        else:
            wrapped = DistributedDataParallel(model)
            if arm == "torch-python-hook":  # torch against itself: the noise floor of this comparison
                wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
        arms[arm] = (wrapped, opt, batches, loss_fn)

    def step(arm: str) -> None:
        wrapped, opt, batches, loss_fn = arms[arm]
        loss_of(wrapped, next(batches), loss_fn).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = time_interleaved({arm: (lambda a=arm: step(a)) for arm in arms}, spec["reps"])
    if world.rank == 0:
        Path(out_path).write_text(
            json.dumps(
                {
                    "seconds": seconds,
                    "interconnect": inter,
                    "interconnect_line": describe(inter),
                    "parameters": sum(p.numel() for p in arms["torch"][0].parameters()),
                }
            )
        )
    islands.close_world(world)


# ---- 2. DiLoCo: islands' and torchft's, as two runs of two replicas ---------------------------------
def _islands_diloco_worker(out_path: str, spec_json: str, rate: str) -> None:
    import torch

    import islands
    from islands.measure import describe, probe_interconnect
    from islands_bench.experiments.user_models import loss_of, make

    spec = json.loads(spec_json)
    torch.set_num_threads(1)
    world = islands.init_world(islands=2)
    inter = probe_interconnect(world)
    model, batches, val, loss_fn = make(spec["model"], world.rank, world.size, spec["batch"], spec.get("data_seed", 0))
    inner = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    strategy = islands.outer.DiLoCo(
        spec["inner_steps"], outer_optimizer=islands.outer.OuterSGD(0.7, 0.9, nesterov=True)
    )
    model = strategy.wrap(model, inner, world)
    inner_t, sync_t = [], []
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        loss_of(model, next(batches), loss_fn).backward()
        inner.step()
        inner.zero_grad(set_to_none=True)
        strategy.after_step(model, inner, step)
        (sync_t if (step + 1) % spec["inner_steps"] == 0 else inner_t).append(time.perf_counter() - t0)
    strategy.finish(model)  # nothing left: the run ends on a synchronisation
    metrics = islands.evaluate(strategy.eval_model(model), val, loss_fn, world.device)
    ledgers = world.all_gather_object(world.ledger.snapshot())
    if world.rank == 0:
        Path(out_path).write_text(
            json.dumps(
                {
                    **metrics,
                    "sent_bytes": sum(led["total_sent"] for led in ledgers) / world.size,
                    "inner_step_s": statistics.median(inner_t),
                    "sync_step_s": statistics.median(sync_t),
                    "interconnect": inter,
                    "interconnect_line": describe(inter),
                }
            )
        )
    islands.close_world(world)


def _torchft_replica(spec_path: str) -> int:
    """One torchft replica group of one worker (run as a subprocess)."""
    from datetime import timedelta

    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    import islands
    from islands_bench.experiments.user_models import loss_of, make

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    model, batches, val, loss_fn = make(spec["model"], spec["rank"], spec["replicas"], spec["batch"])
    inner = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    timeout = timedelta(seconds=120)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=spec["replicas"],
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=f"r{spec['rank']}",
        hostname="127.0.0.1",
    )
    inner_t, sync_t = [], []
    with DiLoCo(
        manager,
        [model],
        inner,
        outer,
        sync_every=spec["inner_steps"],
        backup_device=torch.device("cpu"),
        pin_memory=False,
    ):
        for step in range(spec["steps"]):
            t0 = time.perf_counter()
            loss_of(model, next(batches), loss_fn).backward()
            inner.step()  # DiLoCo's hook syncs every sync_every-th step
            inner.zero_grad(set_to_none=True)
            (sync_t if (step + 1) % spec["inner_steps"] == 0 else inner_t).append(time.perf_counter() - t0)
    metrics = islands.evaluate(model, val, loss_fn, torch.device("cpu"))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    Path(spec["out"]).write_text(
        json.dumps(
            {
                **metrics,
                "sent_bytes": params * (spec["steps"] // spec["inner_steps"]),
                "committed": manager.current_step(),
                "inner_step_s": statistics.median(inner_t),
                "sync_step_s": statistics.median(sync_t),
            }
        )
    )
    manager.shutdown(wait=False)
    return 0


def _run_torchft(ctx: BenchContext, spec: dict, label: str) -> dict:
    run_dir = ctx.out_dir / label
    run_dir.mkdir(parents=True, exist_ok=True)
    lighthouse = subprocess.Popen(
        [sys.executable, "-c", LIGHTHOUSE, "2"],
        stdout=subprocess.PIPE,
        stderr=open(run_dir / "lighthouse.log", "w"),  # noqa: SIM115 - the child process writes its log after this returns
        text=True,
    )
    procs = []
    try:
        port = lighthouse.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"torchft lighthouse did not start: {(run_dir / 'lighthouse.log').read_text()[-800:]}")
        for r in range(2):
            path = run_dir / f"r{r}.json"
            (run_dir / f"r{r}.spec.json").write_text(
                json.dumps(
                    {**spec, "rank": r, "replicas": 2, "out": str(path), "lighthouse": f"http://127.0.0.1:{port}"}
                )
            )
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "islands_bench.experiments.wrapper_overhead",
                        "torchft",
                        str(run_dir / f"r{r}.spec.json"),
                    ],
                    env=dict(os.environ, OMP_NUM_THREADS="1"),
                    stdout=open(run_dir / f"r{r}.log", "w"),  # noqa: SIM115 - the child process writes its log after this returns
                    stderr=subprocess.STDOUT,
                )
            )
        for r, p in enumerate(procs):
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"torchft replica r{r} failed: {(run_dir / f'r{r}.log').read_text()[-1500:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.kill()
        lighthouse.wait(timeout=30)
    return json.loads((run_dir / "r0.json").read_text())


@experiment(
    "wrapper-overhead",
    practices=("SOTA-047", "SOTA-155"),
    help="islands' DDP wrapper against torch DDP (step time), islands' DiLoCo against torchft's (loss, bytes, "
    "step time), same model and run",
)
def wrapper_overhead(ctx: BenchContext) -> dict:
    rows, lines = [], []
    have_hf = True
    try:
        import transformers  # noqa: F401
    except ImportError:
        have_hf = False
        ctx.log("transformers is not installed: the GPT-2 rows are skipped (pip install islands[hf])")
    for kind in ("cnn", "gpt2") if have_hf else ("cnn",):
        spec = {
            "model": kind,
            "batch": 16 if kind == "cnn" else 8,
            "reps": 3 if ctx.smoke else 30 if ctx.quick else 300,
        }
        ctx.log(f"DDP step time, islands vs torch, {kind}, {spec['reps']} interleaved steps per arm")
        got = run_module_ranks(
            "islands_bench.experiments.wrapper_overhead", ["ddp", json.dumps(spec)], 2, ctx.out_dir / f"ddp-{kind}.json"
        )
        s = got["seconds"]
        rows.append(
            {
                "comparison": "DDP step",
                "model": kind,
                "parameters": got["parameters"],
                "islands_ms": 1000 * s["islands"],
                "reference_ms": 1000 * s["torch"],
                "reference": "torch DDP",
                "ratio": s["islands"] / s["torch"],
                "goal": f"<= 1.02 (torch's own Python hook: {s['torch-python-hook'] / s['torch']:.3f}x)",
                "interconnect": got["interconnect_line"],
            }
        )
        lines.append(got["interconnect_line"])
    try:
        import torchft  # noqa: F401
    except ImportError:
        ctx.log("torchft is not installed: the DiLoCo comparison is skipped (pip install islands[peers])")
    else:
        kind = "gpt2" if have_hf else "cnn"
        spec = {
            "model": kind,
            "batch": 8 if kind == "gpt2" else 16,
            "lr": 2e-3,
            "inner_steps": 10,
            "steps": 20 if ctx.smoke else 40 if ctx.quick else 120,
        }
        ctx.log(f"DiLoCo, islands vs torchft, {kind}, 2 replicas, H={spec['inner_steps']}, {spec['steps']} steps")
        # the two jobs run one after the other, so their step times meet different moments of a shared machine:
        # alternate them (islands, torchft, islands, torchft) and take each one's median over its runs
        mines, theirs_runs = [], []
        for i in range(1 if ctx.quick else 2):
            mines.append(
                run_module_ranks(
                    "islands_bench.experiments.wrapper_overhead",
                    ["diloco", json.dumps(spec)],
                    2,
                    ctx.out_dir / f"diloco-islands-{i}.json",
                )
            )
            theirs_runs.append(_run_torchft(ctx, spec, f"diloco-torchft-{i}"))
        mine, theirs = dict(mines[0]), dict(theirs_runs[0])
        for key in ("inner_step_s", "sync_step_s"):
            mine[key] = statistics.median(r[key] for r in mines)
            theirs[key] = statistics.median(r[key] for r in theirs_runs)
        # the noise to judge "the same loss" by: islands again with another data order (same weights, same shards)
        again = run_module_ranks(
            "islands_bench.experiments.wrapper_overhead",
            ["diloco", json.dumps({**spec, "data_seed": 1})],
            2,
            ctx.out_dir / "diloco-islands-seed1.json",
        )
        noise = abs(again["val_loss"] - mine["val_loss"])
        lines.append(mine["interconnect_line"])
        for what, a, b in (
            ("final val loss", mine["val_loss"], theirs["val_loss"]),
            ("MB sent per replica", mine["sent_bytes"] / 1e6, theirs["sent_bytes"] / 1e6),
            ("inner step ms", 1000 * mine["inner_step_s"], 1000 * theirs["inner_step_s"]),
            ("synchronising step ms", 1000 * mine["sync_step_s"], 1000 * theirs["sync_step_s"]),
        ):
            rows.append(
                {
                    "comparison": f"DiLoCo {what}",
                    "model": kind,
                    "islands_ms": a,
                    "reference_ms": b,
                    "reference": "torchft DiLoCo",
                    "ratio": a / b,
                    "goal": (
                        f"|difference| {abs(a - b):.4f} within the data-order noise {noise:.4f}"
                        if "loss" in what
                        else "<= 1"
                    ),
                    "interconnect": mine["interconnect_line"],
                }
            )
    for r in rows:
        r["islands_ms"], r["reference_ms"], r["ratio"] = (
            round(r["islands_ms"], 4),
            round(r["reference_ms"], 4),
            round(r["ratio"], 4),
        )
    headline = []
    for r in rows:
        name = r["comparison"]
        unit = "" if "loss" in name else (" MB" if "MB" in name else " ms")
        headline.append(
            f"{name} ({r['model']}): islands {r['islands_ms']}{unit} vs {r['reference']} "
            f"{r['reference_ms']}{unit}: {r['ratio']:.3f}x (goal {r['goal']})"
        )
    return {
        "rows": rows,
        "headline": headline,
        "interconnect": sorted(set(lines)),
        "baseline": [
            "torch's DistributedDataParallel with its own all-reduce hook (DDP rows) and torchft's "
            "local_sgd.DiLoCo with a Lighthouse (DiLoCo rows), on the same model, data and optimizers, "
            "2 processes with 1 thread each on gloo loopback, same run"
        ],
    }


if __name__ == "__main__":
    if sys.argv[1] == "torchft":
        code = _torchft_replica(sys.argv[2])
        sys.stdout.flush()
        os._exit(code)  # torchft's server threads must not keep a finished replica alive
    out, which, spec = sys.argv[1], sys.argv[2], sys.argv[3]
    {"ddp": _ddp_worker, "diloco": _islands_diloco_worker}[which](out, spec, sys.argv[4] if len(sys.argv) > 4 else "")
