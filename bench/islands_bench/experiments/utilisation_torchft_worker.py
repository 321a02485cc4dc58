"""One torchft replica of the utilisation experiment (run as a subprocess, never imported by islands).

    python -m islands_bench.experiments.utilisation_torchft_worker SPEC.json

Trains the task our run trains (islands.app.build.build_task: same model, data shard, seed, AdamW inner optimizer
with the same betas, lr schedule and grad clip) under torchft's DiLoCo (torchft.local_sgd.DiLoCo: F model fragments,
each synced every H inner steps, its all-reduce started `fragment_sync_delay` steps before it is waited on; F=1 and
delay 0 is plain DiLoCo), with the outer step our runs use (plain SGD, lr sqrt(2), no momentum), one replica group
of size 1 per island, coordinated by a torchft Lighthouse. torchft's public API only.

Blocked time is timed the way our trainer times it (the loop blocked on the outer strategy): torchft runs its
quorum, all-reduce and outer step inside the inner optimizer's step post-hook, so a post-hook registered before
torchft's and one registered after it bracket exactly that work; their gap, summed over the run, is the blocked
time. The wall time runs from the common start barrier to the end of the last step (evaluation excluded, as in
our runs). Written to SPEC["out"] as one JSON object.
"""

from __future__ import annotations

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


def fragments_of(model, count: int):
    """The model's parameters split into `count` modules of consecutive parameters with about equal sizes
    (torchft takes its fragments as modules; the parameter objects are shared, so its in-place updates reach
    the model)."""
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if count < 1 or count > len(params):
        raise ValueError(f"fragments must be in 1..{len(params)} (the model's parameter tensors); got {count}")
    total = sum(p.numel() for _, p in params)
    parts = [torch.nn.Module() for _ in range(count)]
    done = 0
    for name, p in params:  # a tensor goes to the fragment its midpoint falls in
        parts[min(count - 1, int((done + p.numel() / 2) * count / total))].register_parameter(name.replace(".", "_"), p)
        done += p.numel()
    if any(not part._parameters for part in parts):
        raise ValueError(
            f"cannot split the model into {count} fragments of about equal size: one would be empty "
            f"(tensor sizes {[p.numel() for _, p in params]})"
        )
    return parts


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from islands import WarmupCosine, evaluate
    from islands.app.build import build_task
    from islands.config import load_json
    from islands.data import batch_source

    cfg = load_json(Path(spec["config"]))
    task = build_task(cfg)
    batches = batch_source(task.train_data, spec["shard"], spec["shards"], task.batch_size, cfg.train.seed)
    schedule = WarmupCosine(cfg.train.warmup, cfg.train.steps, cfg.train.min_lr_ratio)
    model, h, steps = task.model, spec["inner_steps"], cfg.train.steps
    inner = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=cfg.train.weight_decay
    )
    frags = fragments_of(model, spec["fragments"])
    outer = [torch.optim.SGD(f.parameters(), lr=spec["outer_lr"], momentum=0.0) for f in frags]
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    timeout = timedelta(seconds=spec["timeout_s"])
    ip = spec["ip"]
    store = torch.distributed.TCPStore(ip, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        min_replica_size=spec["shards"],
        use_async_quorum=False,  # DiLoCo requires a synchronous quorum
        # every replica builds the same model from the seed, as our islands do; healing at step 0 would fetch it
        # over torchft's HTTP transport, which advertises socket.gethostname(): not reachable from a testbed host
        init_sync=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=ip,
        store_port=store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=spec["name"],
        hostname=ip,
    )
    Path(spec["out"] + ".ready").write_text(str(time.time()))
    _wait_for(Path(spec["barrier"]), spec["start_limit_s"])

    marks: list[float] = []
    syncs: list[tuple[int, float]] = []
    inner.register_step_post_hook(lambda *_: marks.append(time.perf_counter()))  # before torchft's hook
    step = 0
    with DiLoCo(
        manager,
        frags,
        inner,
        outer,
        sync_every=h,
        backup_device=torch.device("cpu"),
        pin_memory=False,
        fragment_sync_delay=spec["delay"],
    ):
        # after torchft's hook: the gap to the mark above is what torchft did in this step (quorum, exchange, outer)
        inner.register_step_post_hook(lambda *_: syncs.append((step, time.perf_counter() - marks[-1])))
        wall0 = time.perf_counter()
        for step in range(steps):
            for group in inner.param_groups:
                group["lr"] = cfg.train.lr * schedule(step)
            x, y = batches.next()
            loss = task.loss_fn(model(x), y)
            loss.backward()
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            inner.step()
            inner.zero_grad(set_to_none=True)
        wall = time.perf_counter() - wall0
    metrics = evaluate(model, task.val_data, task.loss_fn, torch.device("cpu"), task.metrics)
    blocked = [s for _, s in syncs]
    heavy = sorted(((round(s, 4), i) for i, s in syncs if s > 0.005), key=lambda t: t[1])
    result = {
        "wall_seconds": wall,
        "blocked_seconds": sum(blocked),
        "steps": steps,
        "committed": manager.current_step(),
        "final_val_loss": metrics["val_loss"],
        "blocked_over_5ms": [{"step": i + 1, "seconds": s} for s, i in heavy],
    }
    Path(spec["out"]).write_text(json.dumps(result))
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m islands_bench.experiments.utilisation_torchft_worker SPEC.json")
    code = main(sys.argv[1])
    sys.stdout.flush()
    os._exit(code)  # torchft's server threads must not keep a finished replica alive
