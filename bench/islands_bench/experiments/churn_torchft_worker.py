"""One torchft replica of the churn experiment's reference run (run as a subprocess, never imported by islands).

    python -m islands_bench.experiments.churn_torchft_worker SPEC.json

The replica trains the same task as our elastic run (islands.app.build.build_task: same model, data shard,
seed, AdamW inner optimizer, lr schedule, grad clip) under torchft's DiLoCo wrapper (inner steps H,
outer Nesterov SGD lr 0.7, momentum 0.9, the step our elastic run is given), one replica group of size 1 per
worker, coordinated by the controller's torchft Lighthouse. torchft's public API only: Manager,
ProcessGroupGloo, local_sgd.DiLoCo.

It appends one JSON line per outer round to SPEC["log"], flushed at once so a SIGKILLed replica leaves
what it had done: {"t": wall time after the round, "step": torchft's committed-step counter,
"committed": whether the round committed, "participants": replicas in its quorum, "loss": last inner
loss}. The controller reads these lines to time its events and to measure the stall.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


def _wait_for(path: Path, limit_s: float) -> None:
    deadline = time.time() + limit_s
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"torchft replica: {path} did not appear within {limit_s:.0f} s")
        time.sleep(0.01)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(1)
    from islands import WarmupCosine, evaluate
    from islands.app.build import build_task
    from islands.config import load_json
    from islands.data import batch_source

    cfg = load_json(Path(spec["config"]))
    task = build_task(cfg)
    batches = batch_source(task.train_data, spec["shard"], spec["shards"], task.batch_size, cfg.train.seed)
    schedule = WarmupCosine(cfg.train.warmup, cfg.train.steps, cfg.train.min_lr_ratio)
    model, h, rounds = task.model, spec["inner_steps"], spec["rounds"]
    inner = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay
    )
    outer = torch.optim.SGD(model.parameters(), lr=spec["outer_lr"], momentum=spec["outer_momentum"], nesterov=True)
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    if spec.get("go"):  # a pre-started joiner: torch, torchft and the task are loaded; wait to be released
        _wait_for(Path(spec["go"]), spec["start_limit_s"])

    timeout = timedelta(seconds=spec["timeout_s"])
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        # heal a joiner with the global model; the inner optimizer state stays local (SOTA-219), as in ours
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,  # DiLoCo requires a synchronous quorum
        timeout=timeout,
        quorum_timeout=timedelta(seconds=spec["quorum_timeout_s"]),
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=spec["name"],
        hostname="127.0.0.1",
        heartbeat_interval=timedelta(milliseconds=spec["heartbeat_interval_ms"]),
    )
    Path(spec["log"] + ".ready").write_text(str(time.time()))
    if spec.get("barrier"):  # the first replicas start together so the first quorum holds all of them
        _wait_for(Path(spec["barrier"]), spec["start_limit_s"])

    with open(spec["log"], "a", buffering=1) as out:
        inner_steps = 0
        with DiLoCo(manager, [model], inner, outer, sync_every=h, backup_device=torch.device("cpu"), pin_memory=False):
            stop_at = Path(spec["stop_at"]) if spec.get("stop_at") else None
            while manager.current_step() < rounds:
                before = manager.current_step()
                if stop_at is not None and inner_steps % h == 0 and stop_at.exists():
                    rounds = min(rounds, int(stop_at.read_text()))  # the harness ends the job at a round all reach
                    if before >= rounds:
                        break
                for group in inner.param_groups:
                    group["lr"] = cfg.train.lr * schedule(before * h + inner_steps % h)
                x, y = batches.next()
                loss = task.loss_fn(model(x), y)
                loss.backward()
                if cfg.train.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
                inner.step()  # DiLoCo's post-hook runs the quorum and the outer exchange every h-th call
                inner.zero_grad(set_to_none=True)
                inner_steps += 1
                if inner_steps % h == 0:
                    out.write(
                        json.dumps(
                            {
                                "t": time.time(),
                                "step": manager.current_step(),
                                "committed": manager.current_step() > before,
                                "participants": manager.num_participants(),
                                "loss": loss.item(),
                            }
                        )
                        + "\n"
                    )
        metrics = evaluate(model, task.val_data, task.loss_fn, torch.device("cpu"), task.metrics)
        digest = hashlib.sha256()  # the replicas' models, compared bit for bit by chaos-torchft
        for t in model.state_dict().values():
            digest.update(t.detach().cpu().contiguous().numpy().tobytes())
        final = {
            "final": True,
            "t": time.time(),
            "step": manager.current_step(),
            "sha256": digest.hexdigest(),
            **metrics,
        }
        out.write(json.dumps(final) + "\n")
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m islands_bench.experiments.churn_torchft_worker SPEC.json")
    code = main(sys.argv[1])
    sys.stdout.flush()
    os._exit(code)  # torchft's server threads must not keep a finished replica alive
