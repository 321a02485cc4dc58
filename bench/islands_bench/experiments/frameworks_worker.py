"""One rank of the `frameworks` experiment (frameworks.py): a transformers GPT-2 from a config, trained through the
Hugging Face Trainer or a LightningModule, alone (DDP over the job) or with islands' callback (DiLoCo across
islands). Run as a script by `islands run`; writes OUT/island<i>-rank<r>.json.

    python frameworks_worker.py SPEC_JSON OUT_DIR

Times every optimizer step (a clock callback placed first) and, inside it, the callback's own work (the outer
strategy's hooks, wrapped with a timer): the callback's cost per step is read against the framework's step in the
same process.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import islands

PACKAGES = ("json", "email", "http")  # Python's own sources as bytes: the same corpus on every machine


class ByteWindows(Dataset):
    def __init__(self, data: torch.Tensor, context: int):
        self.data, self.context = data, context

    def __len__(self):
        return (len(self.data) - 1) // self.context

    def __getitem__(self, i):
        return self.data[i * self.context : (i + 1) * self.context].long()


def corpus() -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join(p.read_bytes() for pkg in PACKAGES for p in sorted((root / pkg).glob("*.py")))
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def gpt2(context: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # every arm starts from the same weights
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=context, n_embd=64, n_layer=2, n_head=2))


def timed_hooks(strategy, spent: list[float]):
    """`strategy` with its step hooks timed into `spent` (one entry per optimizer step: the hooks' seconds)."""
    after_backward, after_step = strategy.after_backward, strategy.after_step
    pending = [0.0]

    def backward_hook(model, step):
        t = time.perf_counter()
        after_backward(model, step)
        pending[0] = time.perf_counter() - t

    def step_hook(model, optimizer, step):
        t = time.perf_counter()
        after_step(model, optimizer, step)
        spent.append(pending[0] + time.perf_counter() - t)

    strategy.after_backward, strategy.after_step = backward_hook, step_hook
    return strategy


@torch.no_grad()
def val_loss(model, data: torch.Tensor, context: int, windows: int) -> float:
    model.eval()
    batch = torch.stack([data[i * context : (i + 1) * context].long() for i in range(windows)])
    return float(model(input_ids=batch, labels=batch).loss)


def train_hf(spec: dict, train: Dataset, callback, clock_cb) -> torch.nn.Module:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock_cb.begin()

        def on_step_end(self, args, state, control, **kw):
            clock_cb.end()

    model = gpt2(spec["context"])
    args = TrainingArguments(
        output_dir=spec["tmp"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["max_grad_norm"],
        save_strategy="no",
        logging_steps=max(spec["steps"], 1),
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=spec.get("seed", 0),  # the data order's seed (the model's weights are seeded apart, in gpt2)
    )
    callbacks = [Clock()] + ([callback] if callback is not None else [])
    trainer = Trainer(model=model, args=args, train_dataset=_as_dicts(train), callbacks=callbacks)
    trainer.train()
    return model


class _as_dicts(Dataset):
    def __init__(self, inner: Dataset):
        self.inner = inner

    def __len__(self):
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, i):
        w = self.inner[i]
        return {"input_ids": w, "labels": w}


def train_lightning(spec: dict, train: Dataset, callback, clock_cb) -> torch.nn.Module:
    import lightning.pytorch as L

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            clock_cb.begin()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            clock_cb.end()

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2(spec["context"])

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])

    workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    module = LM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=workers,
        strategy="ddp" if workers > 1 else "auto",
        max_steps=spec["steps"],
        gradient_clip_val=spec["max_grad_norm"],
        callbacks=[Clock()] + ([callback] if callback is not None else []),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # the data-order seed the Lightning way: its DistributedSampler reads PL_GLOBAL_SEED (which the callback offsets
    # by the island); torch.manual_seed alone left every seed's run on one data order (parity sd 0.000)
    L.seed_everything(spec.get("seed", 0), verbose=False)
    trainer.fit(module, DataLoader(train, batch_size=spec["batch"], shuffle=True))
    return module.model


def train_loop(spec: dict, train: Dataset, strategy, clock_cb):
    """islands' own path, no framework: a plain loop, torch's DDP over the island's group, `strategy.attach`
    (the same DiLoCo, hooks timed alike); the data sharded over the island's workers, shuffled per island."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    world = islands.init_world()
    model = gpt2(spec["context"])
    k, local = world.workers_per_island, world.local_rank
    wrapped = DistributedDataParallel(model) if dist.is_initialized() and k > 1 else model
    # the Trainer's optimizer, as its arguments make it: AdamW, the same weight decay, the gradient norm clipped
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    seed = 100 * spec.get("seed", 0) + world.island  # each island its own data order, as the callbacks seed them
    sampler = DistributedSampler(train, num_replicas=k, rank=local, shuffle=True, seed=seed)
    loader = DataLoader(train, batch_size=spec["batch"], sampler=sampler)
    step, epoch = 0, 0
    with strategy.attach(model, opt, world):
        while step < spec["steps"]:
            sampler.set_epoch(epoch)
            for batch in loader:
                clock_cb.begin()
                wrapped(input_ids=batch, labels=batch).loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_grad_norm"])
                opt.step()
                opt.zero_grad(set_to_none=True)
                clock_cb.end()
                step += 1
                if step == spec["steps"]:
                    break
            epoch += 1
    glob = strategy.eval_model(model)
    with torch.no_grad():
        for p, g in zip(model.parameters(), glob.parameters()):
            p.copy_(g)
    return model, world


class StepClock:
    def __init__(self):
        self.seconds: list[float] = []
        self._t = 0.0

    def begin(self):
        self._t = time.perf_counter()

    def end(self):
        self.seconds.append(time.perf_counter() - self._t)


def main(spec: dict, out: Path) -> None:
    torch.set_num_threads(1)
    data = corpus()
    cut = int(len(data) * 0.9)
    train, held = ByteWindows(data[:cut], spec["context"]), data[cut:]
    clock, hooks = StepClock(), []
    callback, world, strategy = None, None, None
    if spec["framework"] == "loop":
        strategy = timed_hooks(islands.outer.DiLoCo(inner_steps=spec["inner_steps"]), hooks)
        model, world = train_loop(spec, train, strategy, clock)
    elif spec["outer"]:
        strategy = timed_hooks(islands.outer.DiLoCo(inner_steps=spec["inner_steps"]), hooks)
        if spec["framework"] == "hf":
            from islands.integrations.transformers import IslandsCallback as HFCallback

            callback = HFCallback(strategy)
        else:
            from islands.integrations.lightning import IslandsCallback as PLCallback

            callback = PLCallback(strategy)
    if spec["framework"] != "loop":
        model = (train_hf if spec["framework"] == "hf" else train_lightning)(spec, train, callback, clock)
        world = callback.run.join() if callback is not None else None
    loss = val_loss(model, held, spec["context"], spec["val_windows"])
    h = spec["inner_steps"]
    steps = clock.seconds
    # steps that did not synchronise: the outer strategy's hooks only count, so their time is the callback's cost
    plain = [s for i, s in enumerate(steps) if (i + 1) % h]
    plain_hooks = [s for i, s in enumerate(hooks) if (i + 1) % h]
    sync_hooks = [s for i, s in enumerate(hooks) if (i + 1) % h == 0]
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "framework": spec["framework"],
        "outer": spec["outer"],
        "island": world.island if world is not None else 0,
        "islands": world.islands if world is not None else 1,
        "rank": rank,
        "val_loss": loss if math.isfinite(loss) else None,
        "steps": len(steps),
        "step_s": statistics.median(plain) if plain else None,
        "hook_s": statistics.median(plain_hooks) if plain_hooks else None,
        "hook_mean_s": statistics.fmean(plain_hooks) if plain_hooks else None,
        "sync_hook_s": statistics.median(sync_hooks) if sync_hooks else None,
        "cross_bytes": world.ledger.total_sent if world is not None else 0,
        "parameters": sum(p.numel() for p in model.parameters()),
        "rounds": strategy.rounds if spec["outer"] else 0,
        "seed": spec.get("seed", 0),
    }
    island = record["island"]
    (out / f"island{island}-rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
