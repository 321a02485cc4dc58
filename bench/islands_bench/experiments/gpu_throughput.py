"""gpu-throughput: islands' training loop against a plain PyTorch loop of the same model, then DiLoCo with M simulated
islands against one replica at equal tokens (issue #18; SOTA-118 mixed precision, SOTA-155 DiLoCo).

Part 1, the loop's cost: GPT-2 124M (transformers' GPT2Config defaults: 12 layers, width 768, 12 heads, 50,257-token
vocabulary, 1,024 positions) built from its config, bf16 autocast with fp32 master weights, AdamW, gradient clipping
at 1.0, the same pre-made token batches on the device for both. `plain` is the loop a user writes by hand (forward,
loss, backward, clip, step, zero_grad); `islands` is islands.Trainer with its ForwardBackward step in "auto"
precision (bf16 on CUDA), one process, no strategy traffic. Both run in this one invocation, alternated
plain/islands/plain/islands so drift on the machine hits both alike; tokens/s counts the timed steps after a
warm-up. Model FLOPs utilisation (MFU) = achieved model FLOPs / the GPU's dense bf16 peak, with the model's FLOPs
per token taken as 6N + 12 * layers * width * context (weights' forward and backward, plus attention scores; the
PaLM paper's accounting). The peak is looked up by the device's name (PEAK_BF16); an unknown GPU gets tokens/s and
no MFU.

Part 2, DiLoCo on one GPU: the same model on the standard library's source with a byte-level BPE trained on it
(islands.tasks.hf_causal_lm), M islands in one process through islands.simulate (the real strategy code), H inner
steps, the outer step diloco-vs-ddp found best; against one replica taking M x b samples per step, the same steps,
so tokens are equal. Validation loss of the global model on the same held-out windows.

--quick runs a tiny GPT-2 (2 layers, width 64) on whatever device is asked: a check that both parts run, not a
measurement. The claim is `islands bench gpu-throughput --device cuda` on a GPU (scripts/gpu-check).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

import islands
from islands.memory import ForwardBackward
from islands.outer import DiLoCo
from islands.tasks import hf_causal_lm
from islands_bench.harness import BenchContext, experiment

# Dense bf16 peak of one GPU, FLOP/s (vendor data sheets; SXM parts). H200 has H100's tensor cores.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
# shape: (width, layers, heads); GPT-2 124M is (768, 12, 12) with a 50,257-token vocabulary
FULL = dict(
    shape=(768, 12, 12),
    vocab=50257,
    context=1024,
    batch=8,
    warmup=5,
    steps=30,
    repeats=2,
    diloco=dict(islands=4, H=50, steps=300, batch=8, context=256, vocab=50257, lr=6e-4),
)
QUICK = dict(
    shape=(64, 2, 2),
    vocab=512,
    context=64,
    batch=4,
    warmup=2,
    steps=6,
    repeats=1,
    diloco=dict(islands=2, H=5, steps=20, batch=4, context=32, vocab=300, lr=3e-3),
)
OUTER = dict(outer="sgd", outer_lr=1.0, momentum=0.0, lr_scale="sqrt-islands")  # diloco-vs-ddp's best
GRAD_CLIP, LR, BETAS, WEIGHT_DECAY = 1.0, 6e-4, (0.9, 0.95), 0.1  # GPT-2-style AdamW (nanoGPT's defaults)


def _gpt2(tier: dict, vocab: int, context: int, device) -> torch.nn.Module:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise SystemExit(
            "gpu-throughput builds GPT-2 with transformers, which is not installed here: "
            "pip install 'islands[hf]' (a GPU machine without the network: docs/gpu.md)"
        ) from None

    torch.manual_seed(0)
    d, layers, heads = tier["shape"]
    config = GPT2Config(vocab_size=vocab, n_positions=context, n_embd=d, n_layer=layers, n_head=heads, use_cache=False)
    return GPT2LMHeadModel(config).to(device)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def lm_loss(out, targets):
    """Next-token cross-entropy on a transformers output (its logits) or a plain tensor; fp32 softmax."""
    logits = _logits(out)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _optimizer(model, device):
    fused = device.type == "cuda"  # what a careful plain loop uses on a GPU; islands' loop gets the same one
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=fused)


def _batches(tier: dict, device, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, tier["vocab"], (n, tier["batch"], tier["context"] + 1), generator=g)
    return [(b[:, :-1].contiguous().to(device), b[:, 1:].contiguous().to(device)) for b in ids]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(tier: dict, device, read_loss: bool = False) -> float:
    """Seconds for tier["steps"] timed steps of the hand-written loop (after tier["warmup"] untimed ones);
    `read_loss`: the loop a user writes with `loss.item()` every step (a wait on the device each step)."""
    model = _gpt2(tier, tier["vocab"], tier["context"], device)
    opt = _optimizer(model, device)
    batches = _batches(tier, device)
    bf16 = device.type == "cuda"
    start = 0.0
    for i in range(tier["warmup"] + tier["steps"]):
        if i == tier["warmup"]:
            _sync(device)
            start = time.perf_counter()
        x, y = batches[i % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if read_loss:
            loss.item()
    _sync(device)
    return time.perf_counter() - start


def plain_loop_reading_loss(tier: dict, device) -> float:
    return plain_loop(tier, device, read_loss=True)


class _Clock:
    """A callback that starts the clock after the warm-up steps (the Trainer's callbacks see every step end)."""

    reads_loss = False  # a callback that read each step's loss would make the GPU wait every step

    def __init__(self, warmup: int, device):
        self.warmup, self.device, self.start = warmup, device, None

    def on_step_end(self, trainer, loss) -> None:
        if trainer.step == self.warmup:
            _sync(self.device)
            self.start = time.perf_counter()


def islands_loop(tier: dict, device) -> float:
    model = _gpt2(tier, tier["vocab"], tier["context"], device)
    opt = _optimizer(model, device)
    batches = _batches(tier, device)
    clock = _Clock(tier["warmup"], device)
    trainer = islands.Trainer(
        model=model,
        optimizer=opt,
        loss_fn=lm_loss,
        train_data=batches,
        world=islands.World.single(device),
        strategy=islands.Stack(),
        callbacks=[clock],
        grad_clip=GRAD_CLIP,
        step_fn=ForwardBackward(precision="auto"),
        log_every=10**9,
    )
    trainer.fit(tier["warmup"] + tier["steps"])
    _sync(device)
    return time.perf_counter() - clock.start


def model_flops_per_token(model, tier: dict) -> float:
    n = sum(p.numel() for p in model.parameters())
    cfg = model.config
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_embd * tier["context"]


def peak_flops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def _diloco_arm(tier: dict, device, arm: str) -> dict:
    d = tier["diloco"]
    m = d["islands"] if arm == "diloco" else 1
    width, layers, heads = tier["shape"]
    task = hf_causal_lm(
        model="gpt2",
        d_model=width,
        n_layers=layers,
        n_heads=heads,
        tokenizer="bpe",
        vocab_size=d["vocab"],
        context=d["context"],
        batch_size=d["batch"] * (1 if arm == "diloco" else d["islands"]),
        eval_batches=8,
        seed=0,
    )

    def fit(world):
        model = copy.deepcopy(task.model).to(world.device)
        opt = torch.optim.AdamW(model.parameters(), lr=d["lr"], betas=BETAS, weight_decay=WEIGHT_DECAY)
        strategy = (
            islands.Stack(outer=DiLoCo.from_options(inner_steps=d["H"], **OUTER))
            if arm == "diloco"
            else islands.Stack()
        )
        trainer = islands.Trainer(
            model=model,
            optimizer=opt,
            loss_fn=task.loss_fn,
            train_data=task.train_data,
            world=world,
            strategy=strategy,
            grad_clip=GRAD_CLIP,
            schedule=islands.WarmupCosine(max(1, d["steps"] // 10), d["steps"]),
            step_fn=ForwardBackward(precision="auto"),
            batch_size=task.batch_size,
        )
        trainer.fit(d["steps"])
        out = {"sent": world.ledger.snapshot()["total_sent"]}
        if world.rank == 0:
            out.update(islands.evaluate(trainer.eval_model, task.val_data, task.loss_fn, world.device))
        return out

    t = time.perf_counter()
    results = islands.simulate.run(fit, islands=m, device=str(device))
    return {
        "val_loss": results[0]["val_loss"],
        "sent": results[0]["sent"],
        "wall_s": time.perf_counter() - t,
        "params": sum(p.numel() for p in task.model.parameters()),
        "tokens": d["steps"] * d["islands"] * d["batch"] * d["context"],
    }


@experiment(
    "gpu-throughput",
    practices=("SOTA-118", "SOTA-155"),
    devices=("cuda", "cpu"),
    help="islands' loop vs a plain PyTorch loop on GPT-2 124M in bf16 (tokens/s, MFU), then DiLoCo with M "
    "simulated islands vs one replica at equal tokens; meant for --device cuda",
)
def gpu_throughput(ctx: BenchContext) -> dict:
    tier = dict(QUICK if ctx.quick else FULL)
    device = torch.device("cuda" if ctx.device == "cuda" else "cpu")
    ctx.plan(3 * tier["repeats"] + 2)
    times: dict[str, list[float]] = {"plain": [], "islands": [], "plain+item": []}
    for r in range(tier["repeats"]):
        for name, fn in (("plain", plain_loop), ("islands", islands_loop), ("plain+item", plain_loop_reading_loss)):
            with ctx.arm(f"{name}-{r}"):
                times[name].append(fn(tier, device))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    probe = _gpt2(tier, tier["vocab"], tier["context"], "cpu")
    params = sum(p.numel() for p in probe.parameters())
    flops_token = model_flops_per_token(probe, tier)
    tokens = tier["steps"] * tier["batch"] * tier["context"]
    peak = peak_flops(device)
    rows = []
    for name, ts in times.items():
        best = min(ts)  # the least disturbed run of each, alternated
        tps = tokens / best
        rows.append(
            {
                "part": "loop",
                "arm": name,
                "params": params,
                "tokens_per_step": tier["batch"] * tier["context"],
                "seconds": [round(t, 3) for t in ts],
                "tokens_per_s": round(tps, 1),
                "mfu_pct": round(100 * tps * flops_token / peak, 2) if peak else None,
            }
        )
    plain, ours, reading = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"], rows[2]["tokens_per_s"]
    cost_pct = 100.0 * (plain / ours - 1.0)
    read_pct = 100.0 * (plain / reading - 1.0)
    arms = {}
    for arm in ("single", "diloco"):
        with ctx.arm(f"diloco-part-{arm}"):
            arms[arm] = _diloco_arm(tier, device, arm)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    d = tier["diloco"]
    gap = 100.0 * (arms["diloco"]["val_loss"] / arms["single"]["val_loss"] - 1.0)
    for arm, r in arms.items():
        rows.append(
            {
                "part": "diloco",
                "arm": arm,
                "params": r["params"],
                "islands": d["islands"] if arm == "diloco" else 1,
                "tokens": r["tokens"],
                "final_val_loss": r["val_loss"],
                "wall_s": round(r["wall_s"], 1),
                "bytes_sent": r["sent"],
            }
        )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    where = f"one {gpu}, one process (no link: part 2's islands are simulated, bytes are ledger payload)"
    mfu = (
        f"; MFU plain {rows[0]['mfu_pct']}%, islands {rows[1]['mfu_pct']}% of {peak / 1e12:.0f} TFLOP/s bf16"
        if peak
        else "; MFU not stated (no bf16 peak known for this device)"
    )
    headline = [
        f"{'quick tier (tiny GPT-2, a check that the parts run, not a measurement): ' if ctx.quick else ''}"
        f"GPT-2 {params / 1e6:.1f}M, batch {tier['batch']} x {tier['context']} tokens, "
        f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}: plain loop {plain:,.0f} tokens/s, islands' loop "
        f"{ours:,.0f} tokens/s: islands costs {cost_pct:+.2f}% (goal <= 3%){mfu}",
        f"the plain loop reading loss.item() every step: {reading:,.0f} tokens/s ({read_pct:+.2f}% against the "
        f"plain loop; islands' loop reads the loss only at its log entries)",
        f"DiLoCo, {d['islands']} simulated islands, H={d['H']}, {d['steps']} steps, against one replica on "
        f"{d['islands']}x the batch (equal tokens, {arms['diloco']['tokens']:,}): final val loss "
        f"{arms['diloco']['val_loss']:.4f} vs {arms['single']['val_loss']:.4f} ({gap:+.2f}%)",
        f"where: {where}",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "interconnect": [where],
        "baseline": [
            "part 1: a hand-written PyTorch loop of the same model, optimizer, precision and batches, "
            "alternated with islands' loop in this run; part 2: one replica at equal tokens"
        ],
        "loop_cost_pct": cost_pct,
        "loss_read_cost_pct": read_pct,
        "diloco_gap_pct": gap,
    }
