"""gpu-throughput: islands' training loop against a plain PyTorch loop of the same model, eager and compiled, then
DiLoCo with M simulated islands against one replica at equal tokens (issue #18, issue #34 item 2; SOTA-118 mixed
precision, SOTA-155 DiLoCo).

Part 1, the loop's cost: GPT-2 124M (transformers' GPT2Config defaults: 12 layers, width 768, 12 heads, 50,257-token
vocabulary, 1,024 positions) built from its config with SDPA attention, bf16 autocast with fp32 master weights,
AdamW (fused on CUDA), gradient clipping at 1.0, the same pre-made token batches on the device for every arm.
`plain` is the loop a user writes by hand (forward, loss, backward, clip, step, zero_grad); `islands` is
islands.Trainer with its ForwardBackward step in "auto" precision (bf16 on CUDA), one process, no strategy traffic;
`plain+item` is the plain loop reading loss.item() every step. `plain-compiled` is the plain loop on
`torch.compile(model)` and `islands-compiled` the Trainer with `compile=islands.Compile(...)`: mode default, backend
inductor on CUDA, aot_eager elsewhere (it traces forward and backward like inductor but generates no code, so the
CPU needs no C++ compiler and the quick tier exercises the wiring). All arms run in this one invocation, alternated
so drift on the machine hits them alike; tokens/s counts the timed steps after `warmup` untimed ones. The warm-up
takes the compilation: the first compiled arm compiles forward and backward in its first step, and the later ones
reuse torch's compiled graphs (the same model class, shapes and autocast), so every timed step is steady state.
Each arm's warm-up excess (its warm-up wall time less `warmup` steady steps) is reported; the first compiled arm's
is the compile time. Model FLOPs utilisation (MFU) = achieved model FLOPs / the GPU's dense bf16 peak, with the
model's FLOPs per token taken as 6N + 12 * layers * width * context (weights' forward and backward, plus attention
scores; the PaLM paper's accounting). The peak is looked up by the device's name (PEAK_BF16); an unknown GPU gets
tokens/s and no MFU. Goals: islands' eager loop at most 3% slower than the plain one; compiled, at most 2% slower
than the compiled plain loop and at least 40% MFU (issue #34).

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
from typing import NamedTuple

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
    compiled_repeats=2,  # inductor compiles once (~1 minute); the later compiled arms reuse its graphs (seconds each)
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
    compiled_repeats=1,
    diloco=dict(islands=2, H=5, steps=20, batch=4, context=32, vocab=300, lr=3e-3),
)
OUTER = dict(outer="sgd", outer_lr=1.0, momentum=0.0, lr_scale="sqrt-islands")  # diloco-vs-ddp's best
GRAD_CLIP, LR, BETAS, WEIGHT_DECAY = 1.0, 6e-4, (0.9, 0.95), 0.1  # GPT-2-style AdamW (nanoGPT's defaults)
EAGER_ARMS, COMPILED_ARMS = ("plain", "islands", "plain+item"), ("plain-compiled", "islands-compiled")
LOOP_COST_GOAL_PCT, COMPILED_COST_GOAL_PCT, MFU_GOAL_PCT = 3.0, 2.0, 40.0  # issue #18; issue #34 item 2


def _gpt2(tier: dict, vocab: int, context: int, device) -> torch.nn.Module:
    """GPT-2 of the tier's shape with SDPA attention, initialised on `device` (the meta device: shapes only)."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise SystemExit(
            "gpu-throughput builds GPT-2 with transformers, which is not installed here: "
            "pip install 'islands[hf]' (a GPU machine without the network: docs/gpu.md)"
        ) from None

    torch.manual_seed(0)
    d, layers, heads = tier["shape"]
    # SDPA is transformers' default today; asked for by name so that the measured attention cannot change unseen
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=context,
        n_embd=d,
        n_layer=layers,
        n_head=heads,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device(device):  # initialised where it trains: a CPU init of 124M parameters costs seconds per arm
        return GPT2LMHeadModel(config)


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


class Timing(NamedTuple):
    """Wall seconds of one arm: its `warmup` untimed steps (a compiled arm's compilation among them) and the
    `steps` timed ones after them."""

    warmup_s: float
    timed_s: float

    def warmup_excess_s(self, tier: dict) -> float:
        """What the warm-up took beyond as many steady steps: a compiled arm's compile time, if it compiled."""
        return self.warmup_s - tier["warmup"] * self.timed_s / tier["steps"]


def compile_backend(device) -> str:
    """inductor on CUDA; aot_eager elsewhere: inductor's CPU kernels need a C++ compiler a machine may lack
    (islands.Compile's check_backend refuses it then), and aot_eager traces the same forward and backward graphs."""
    return "inductor" if device.type == "cuda" else "aot_eager"


def plain_loop(tier: dict, device, read_loss: bool = False, backend: str | None = None) -> Timing:
    """The hand-written loop: tier["warmup"] untimed steps, then tier["steps"] timed ones. `read_loss`: the loop a
    user writes with `loss.item()` every step (a wait on the device each step); `backend`: the forward runs
    `torch.compile(model, backend=backend)` (mode default), the optimizer and clipping the model's parameters."""
    model = _gpt2(tier, tier["vocab"], tier["context"], device)
    forward = torch.compile(model, backend=backend) if backend else model
    opt = _optimizer(model, device)
    batches = _batches(tier, device)
    bf16 = device.type == "cuda"
    _sync(device)
    first = start = time.perf_counter()
    for i in range(tier["warmup"] + tier["steps"]):
        if i == tier["warmup"]:
            _sync(device)
            start = time.perf_counter()
        x, y = batches[i % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = lm_loss(forward(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if read_loss:
            loss.item()
    _sync(device)
    return Timing(start - first, time.perf_counter() - start)


def plain_loop_reading_loss(tier: dict, device) -> Timing:
    return plain_loop(tier, device, read_loss=True)


def plain_loop_compiled(tier: dict, device) -> Timing:
    return plain_loop(tier, device, backend=compile_backend(device))


class _Clock:
    """A callback that starts the clock after the warm-up steps (the Trainer's callbacks see every step end)."""

    reads_loss = False  # a callback that read each step's loss would make the GPU wait every step

    def __init__(self, warmup: int, device):
        self.warmup, self.device, self.start = warmup, device, 0.0

    def on_step_end(self, trainer, loss) -> None:
        if trainer.step == self.warmup:
            _sync(self.device)
            self.start = time.perf_counter()


def islands_loop(tier: dict, device, backend: str | None = None) -> Timing:
    """islands.Trainer on the same model, optimizer and batches; `backend`: compiled by the Trainer itself
    (`compile=islands.Compile(backend)`, mode default), as a user of islands would ask for it."""
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
        compile=islands.Compile(backend=backend) if backend else None,
    )
    _sync(device)
    first = time.perf_counter()
    trainer.fit(tier["warmup"] + tier["steps"])
    _sync(device)
    return Timing(clock.start - first, time.perf_counter() - clock.start)


def islands_loop_compiled(tier: dict, device) -> Timing:
    return islands_loop(tier, device, backend=compile_backend(device))


LOOPS = {
    "plain": plain_loop,
    "islands": islands_loop,
    "plain+item": plain_loop_reading_loss,
    "plain-compiled": plain_loop_compiled,  # first of the compiled arms: its warm-up compiles
    "islands-compiled": islands_loop_compiled,
}


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


def _time_arms(ctx: BenchContext, tier: dict, device) -> dict[str, list[Timing]]:
    """Every arm of part 1 in this one run, alternated: each repeat runs the eager arms, then (while
    tier["compiled_repeats"] last) the compiled ones."""
    times: dict[str, list[Timing]] = {name: [] for name in LOOPS}
    for r in range(max(tier["repeats"], tier["compiled_repeats"])):
        names = (EAGER_ARMS if r < tier["repeats"] else ()) + (COMPILED_ARMS if r < tier["compiled_repeats"] else ())
        for name in names:
            with ctx.arm(f"{name}-{r}"):
                times[name].append(LOOPS[name](tier, device))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return times


def _loop_rows(times: dict[str, list[Timing]], tier: dict, device) -> list[dict]:
    probe = _gpt2(tier, tier["vocab"], tier["context"], "meta")  # shapes only: the FLOPs and the attention
    params = sum(p.numel() for p in probe.parameters())
    flops_token = model_flops_per_token(probe, tier)
    tokens = tier["steps"] * tier["batch"] * tier["context"]
    peak = peak_flops(device)
    rows = []
    for name, runs in times.items():
        tps = tokens / min(t.timed_s for t in runs)  # the least disturbed run of each, alternated
        rows.append(
            {
                "part": "loop",
                "arm": name,
                "params": params,
                "tokens_per_step": tier["batch"] * tier["context"],
                "compile": compile_backend(device) if name in COMPILED_ARMS else None,
                "attention": probe.config._attn_implementation,
                "seconds": [round(t.timed_s, 3) for t in runs],
                "warmup_excess_s": [round(t.warmup_excess_s(tier), 2) for t in runs],
                "tokens_per_s": round(tps, 1),
                "mfu_pct": round(100 * tps * flops_token / peak, 2) if peak else None,
            }
        )
    return rows


def _cost_pct(by_arm: dict, base: str, arm: str) -> float:
    """How much slower `arm` is than `base`, in percent of `base`'s step time."""
    return 100.0 * (by_arm[base]["tokens_per_s"] / by_arm[arm]["tokens_per_s"] - 1.0)


def _mfu_phrase(by_arm: dict, arms: tuple[str, ...], peak: float | None, goal: bool = False) -> str:
    if not peak:
        return "; MFU not stated (no bf16 peak known for this device)"
    mfus = ", ".join(f"{arm} {by_arm[arm]['mfu_pct']}%" for arm in arms)
    verdict = ""
    if goal:
        met = by_arm[arms[-1]]["mfu_pct"] >= MFU_GOAL_PCT
        verdict = f" ({arms[-1]} goal >= {MFU_GOAL_PCT:.0f}%: {'met' if met else 'not met'})"
    return f"; MFU {mfus} of {peak / 1e12:.0f} TFLOP/s bf16{verdict}"


def _loop_headline(by_arm: dict, tier: dict, device, quick: bool) -> list[str]:
    peak = peak_flops(device)
    plain, ours, reading = (by_arm[a]["tokens_per_s"] for a in EAGER_ARMS)
    fast_plain, fast_ours = (by_arm[a]["tokens_per_s"] for a in COMPILED_ARMS)
    compiled_s = [by_arm[a]["warmup_excess_s"][0] for a in COMPILED_ARMS]
    backend = compile_backend(device)
    return [
        f"{'quick tier (tiny GPT-2, a check that the parts run, not a measurement): ' if quick else ''}"
        f"GPT-2 {by_arm['plain']['params'] / 1e6:.1f}M, {by_arm['plain']['attention']} attention, batch "
        f"{tier['batch']} x {tier['context']} tokens, {'bf16 autocast' if device.type == 'cuda' else 'fp32'}: "
        f"plain loop {plain:,.0f} tokens/s, islands' loop {ours:,.0f} tokens/s: islands costs "
        f"{_cost_pct(by_arm, 'plain', 'islands'):+.2f}% (goal <= {LOOP_COST_GOAL_PCT:.0f}%)"
        f"{_mfu_phrase(by_arm, EAGER_ARMS[:2], peak)}",
        f"the plain loop reading loss.item() every step: {reading:,.0f} tokens/s "
        f"({_cost_pct(by_arm, 'plain', 'plain+item'):+.2f}% against the plain loop; islands' loop reads the loss "
        f"only at its log entries)",
        f"compiled ({backend}, mode default): plain loop {fast_plain:,.0f} tokens/s, islands' loop {fast_ours:,.0f} "
        f"tokens/s: islands costs {_cost_pct(by_arm, 'plain-compiled', 'islands-compiled'):+.2f}% (goal <= "
        f"{COMPILED_COST_GOAL_PCT:.0f}%){_mfu_phrase(by_arm, COMPILED_ARMS, peak, goal=True)}; warm-up excess "
        f"{compiled_s[0]:.1f} s (the compilation) and {compiled_s[1]:.1f} s (torch's graphs reused) in "
        f"{tier['warmup']} warm-up steps; {fast_plain / plain:.2f}x the eager plain loop",
    ]


def _diloco_part(ctx: BenchContext, tier: dict, device) -> tuple[list[dict], str, float]:
    """Part 2: (its rows, its headline sentence, DiLoCo's validation-loss gap to one replica in percent)."""
    arms = {}
    for arm in ("single", "diloco"):
        with ctx.arm(f"diloco-part-{arm}"):
            arms[arm] = _diloco_arm(tier, device, arm)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    d = tier["diloco"]
    gap = 100.0 * (arms["diloco"]["val_loss"] / arms["single"]["val_loss"] - 1.0)
    rows = [
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
        for arm, r in arms.items()
    ]
    headline = (
        f"DiLoCo, {d['islands']} simulated islands, H={d['H']}, {d['steps']} steps, against one replica on "
        f"{d['islands']}x the batch (equal tokens, {arms['diloco']['tokens']:,}): final val loss "
        f"{arms['diloco']['val_loss']:.4f} vs {arms['single']['val_loss']:.4f} ({gap:+.2f}%)"
    )
    return rows, headline, gap


@experiment(
    "gpu-throughput",
    practices=("SOTA-118", "SOTA-155"),
    devices=("cuda", "cpu"),
    help="islands' loop vs a plain PyTorch loop on GPT-2 124M in bf16, eager and torch.compile'd (tokens/s, MFU; "
    "goals: compiled, islands <= 2% slower and >= 40% MFU), then DiLoCo with M simulated islands vs one replica "
    "at equal tokens; meant for --device cuda",
)
def gpu_throughput(ctx: BenchContext) -> dict:
    tier = dict(QUICK if ctx.quick else FULL)
    device = torch.device("cuda" if ctx.device == "cuda" else "cpu")
    ctx.plan(len(EAGER_ARMS) * tier["repeats"] + len(COMPILED_ARMS) * tier["compiled_repeats"] + 2)
    rows = _loop_rows(_time_arms(ctx, tier, device), tier, device)
    by_arm = {row["arm"]: row for row in rows}
    headline = _loop_headline(by_arm, tier, device, ctx.quick)
    for line in headline:  # in the log now: a run cut by a time box during part 2 still shows part 1
        ctx.log(f"part 1: {line}")
    diloco_rows, diloco_line, gap = _diloco_part(ctx, tier, device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    where = f"one {gpu}, one process (no link: part 2's islands are simulated, bytes are ledger payload)"
    return {
        "rows": rows + diloco_rows,
        "headline": [*headline, diloco_line, f"where: {where}"],
        "interconnect": [where],
        "baseline": [
            "part 1: a hand-written PyTorch loop of the same model, optimizer, precision and batches, "
            "alternated with islands' loop in this run, eager and compiled alike; part 2: one replica at "
            "equal tokens"
        ],
        "loop_cost_pct": _cost_pct(by_arm, "plain", "islands"),
        "loss_read_cost_pct": _cost_pct(by_arm, "plain", "plain+item"),
        "compiled_loop_cost_pct": _cost_pct(by_arm, "plain-compiled", "islands-compiled"),
        "compiled_mfu_pct": by_arm["islands-compiled"]["mfu_pct"],
        "compile_seconds": by_arm["plain-compiled"]["warmup_excess_s"][0],
        "goals": {
            "loop_cost_pct_at_most": LOOP_COST_GOAL_PCT,
            "compiled_loop_cost_pct_at_most": COMPILED_COST_GOAL_PCT,
            "compiled_mfu_pct_at_least": MFU_GOAL_PCT,
        },
        "diloco_gap_pct": gap,
    }
