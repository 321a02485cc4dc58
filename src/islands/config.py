"""The job config: nested sections, loaded from TOML tables and flags, read only by islands.app.

    [task]        what to learn: lm | digits | hf-causal-lm | module:function, and the built-in models' shapes
    [train]       steps, batch, optimizer and its schedule, evaluation cadence
    [world]       processes, islands, device, timeouts, where the workers run
    [inner]       the strategy inside an island and its exchange (compressor, aggregator, attack, sharding)
    [outer]       the strategy across islands
    [memory]      activation checkpointing, precision, micro-batches
    [checkpoint]  levels, intervals, resume
    [elastic]     membership that changes while the job runs
    [output]      where the run record goes, the progress bar, the loggers

Every key has one description, beside its definition (`_key(default, help)`); `descriptions()` reads them for
`islands train --help` and docs/config.md's key reference (`write_reference`).

Today's flat keys (`workers = 4`, `--ckpt-every 50`) keep working as aliases of their section keys
(FLAT, below). Every problem is a ConfigError naming the key, what was given and what would be valid;
the CLI turns it into exit code 2. Cross-section rules live in islands.app.validate.

Spec-valued keys (a compressor, an aggregator, an attack, an outer strategy, an optimizer, a wrap policy,
the checkpoint interval policy) are parsed ONCE, here at the edge, into `islands.spec.Spec` values, which
travel in the job JSON as values ({"name", "args"}); the words that mean "nothing" (compressor none,
aggregator mean, an empty string) become None. islands.app checks each against its registry and builds it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from islands.spec import Spec, SpecError, format as format_spec, parse


class ConfigError(ValueError):
    """A bad job configuration; the message says what is wrong and what would be right."""


def _key(default=MISSING, help: str = "", *, factory=MISSING):
    """A config key: its default and its one-line description, the only one (`islands train --help` and
    docs/config.md read it through `description`). `factory` for mutable defaults (specs, tables)."""
    return field(default=default, default_factory=factory, metadata={"help": help})


@dataclass
class TaskConfig:
    name: str = _key(
        "lm",
        "what to train: lm (byte-level transformer), digits (MLP on sklearn's 8x8 digits), "
        "hf-causal-lm (a transformers causal LM; docs/hf-models.md) or module:function returning an "
        "islands.Task (docs/own-model.md)",
    )
    data: str = _key(
        "",
        "training text for lm and hf-causal-lm: a text file or directory (hf-causal-lm also JSON "
        'lines, Parquet or a glob); "" = the Python standard library\'s source',
    )
    d_model: int = _key(128, "model width (lm, and an hf-causal-lm family built fresh)")
    n_layers: int = _key(4, "transformer blocks (lm, and an hf-causal-lm family built fresh)")
    n_heads: int = _key(4, "attention heads, a divisor of d_model (lm, and an hf-causal-lm family built fresh)")
    context: int = _key(128, "tokens per training sequence (bytes for lm; hf-causal-lm: at most the model's positions)")
    hidden: int = _key(128, "digits: width of the MLP's hidden layer")
    model: str = _key(
        "gpt2",
        "hf-causal-lm: a family built fresh (gpt2, llama, qwen2 or any causal-LM model_type) "
        "or a local model directory",
    )
    model_overrides: str = _key(
        "",
        "hf-causal-lm: model config keys to set, e.g. 'n_layer=2,n_embd=64' (an unknown "
        "key is an error; docs/hf-models.md)",
    )
    tokenizer: str = _key(
        "auto",
        "hf-causal-lm: auto (the model directory's tokenizer.json, else bpe), bpe (trained "
        "on the training text), byte, or a tokenizer.json path",
    )
    vocab_size: int = _key(
        512, "hf-causal-lm: tokens of the BPE trained on the training text, and the fresh model's embedding rows"
    )
    text_column: str = _key(
        "text", "hf-causal-lm with JSON lines or Parquet data (read through `datasets`): the column holding the text"
    )
    options: dict = _key(
        help="free keys for a user's make_task, read as cfg.task.options (TOML table [task.options]; no flag)",
        factory=dict,
    )


@dataclass
class TrainConfig:
    steps: int = _key(200, "optimizer steps to train for; the lr schedule ends its decay here")
    global_batch: int = _key(
        32, "samples (sequences or images) per step summed over all workers; a multiple of world.workers"
    )
    lr: float = _key(3e-3, "peak learning rate, reached at the end of the warm-up")
    warmup: int = _key(
        30,
        "steps of linear lr warm-up before the cosine decay (also post-local-sgd's switch step "
        "unless its spec gives one)",
    )  # SOTA-216
    min_lr_ratio: float = _key(0.1, "the cosine decay's final lr as a fraction of lr, in [0, 1]")
    weight_decay: float = _key(0.1, "the optimizer's decoupled weight decay (AdamW's)")
    grad_clip: float = _key(
        1.0, "largest global gradient norm: larger gradients are scaled down to it; 0 = no clipping"
    )
    seed: int = _key(0, "seed of the model's initialisation, the data order, and seeded compressors and attacks")
    optimizer: Spec | None = _key(
        help="optimizer spec: adamw, onebit-adam, naive-compressed-adam, split-adamw or "
        "muon (with key=value arguments)",
        factory=lambda: Spec("adamw"),
    )
    eval_every: int = _key(25, "steps between validation passes (also at step 0 and at the end); 0 = only at the end")
    eval_batches: int = _key(
        8, "validation batches per evaluation (lm and hf-causal-lm; digits evaluates its whole validation split)"
    )
    log_every: int = _key(10, "steps per point of the recorded training-loss series (the mean over those steps)")
    compile: bool = _key(
        False,
        "run forward and backward through torch.compile, applied after the strategy wraps the model; run.json "
        "and the summary give the compile time (docs/own-model.md, Compiled models)",
    )
    compile_backend: str = _key(
        "inductor",
        "train.compile's backend: inductor (generated kernels; on the CPU it needs a C++ compiler) or any "
        "torch._dynamo backend, e.g. aot_eager (traces forward and backward, generates nothing)",
    )
    compile_mode: str = _key(
        "default", "train.compile's mode: default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs"
    )


@dataclass
class WorldConfig:
    workers: int = _key(4, "worker processes in all, over every island")
    islands: int = _key(
        1,
        "islands the workers are split into (workers/islands each); more than one needs an "
        "outer strategy (or inner.strategy fsdp)",
    )
    threads: int = _key(1, "torch threads (OMP_NUM_THREADS) per worker; one worker per core is the fair CPU comparison")
    device: str = _key(
        "auto",
        "auto (cuda + nccl when every local worker gets its own GPU, else cpu + gloo), cpu or cuda (a GPU per "
        "local worker, or islands sharing GPUs: nccl inside each, gloo across; docs/gpu.md)",
    )
    cross_backend: str = _key(
        "auto",
        "the backend between islands: auto (the world's, but gloo for a GPU job on a testbed or whose islands "
        "share GPUs), gloo (device "
        "tensors cross through host buffers; fails rather than hangs on a dead peer) or nccl (a GPU world only)",
    )
    timeout: float = _key(
        120.0, "seconds a collective (or a checkpoint barrier) may block before the job is declared dead"
    )
    port: int = _key(0, "rendezvous port; 0 = pick a free one (keep 0 with a testbed)")
    testbed: str = _key(
        "", 'run each worker inside a host of this network testbed (`islands testbed up`); "" = plain local processes'
    )
    probe: bool = _key(True, "measure the interconnect between workers at the start and record it in run.json")
    slowdown: str = _key(
        "",
        'rehearse slower hosts: "1=2.0" makes island 1 compute 2x slower, "rank3=1.5" one '
        'rank (islands.faults.slowdown); "" = none',
    )
    simulate: bool = _key(
        False,
        "run the islands (one worker each) as threads of this process on one device, with "
        "the real strategy code (docs/simulate.md)",
    )


@dataclass
class InnerConfig:
    strategy: str = _key(
        "auto",
        "the strategy inside an island: auto (single for one worker, else ddp), single, ddp, zero1, fsdp or pipeline",
    )
    compressor: Spec | None = _key(
        None, "ddp: gradient compressor spec, e.g. powersgd:rank=4, topk, int8; none = DDP's plain mean"
    )
    aggregator: Spec | None = _key(
        None, "ddp: robust gradient aggregator spec, e.g. median, nnm+krum:f=1; mean = DDP's plain mean"
    )
    attack: Spec | None = _key(None, "ddp: a Byzantine attack to rehearse, e.g. sign-flip:count=1; none = no attack")
    bucket_mb: float = _key(
        25.0, "ddp and zero1: MiB per gradient bucket (torch's default 25, Horovod's fusion buffer 64)"
    )  # LIT-220
    overlap: bool = _key(
        True,
        "ddp with a compressor: compress each bucket on a worker thread while backward goes "
        "on; off: inside the hook on the autograd thread",
    )
    wrap: Spec | None = _key(
        help="fsdp: the shard units: model, block (each block of a ModuleList or Sequential), "
        "params:N, split:K or graph:K",
        factory=lambda: Spec("block"),
    )
    reshard: bool = _key(
        True,
        "fsdp: free gathered parameters after forward and gather them again for backward "
        "(ZeRO-3); off: keep them (ZeRO-2-like)",
    )
    prefetch: int = _key(
        0, "fsdp: shard units gathered ahead in forward and backward; 0 = FSDP2's own prefetching"
    )  # SOTA-117
    shard_group: str = _key(
        "",
        'fsdp: ranks per sharding group: "" = the island, auto = the smallest group that '
        "fits shard_budget_mb, or N (groups replicate each other: HSDP)",
    )  # SOTA-119
    shard_budget_mb: float = _key(
        0.0, "fsdp with shard_group auto: MiB of state per rank the group must fit; 0 = the device's memory"
    )
    stages: int = _key(0, "pipeline: stages, one worker each; 0 = the workers of an island")
    microbatches: str = _key(
        "auto",
        "pipeline: micro-batches per step (a divisor of the island's batch), or auto "
        "(the fastest predicted count that fits activation_budget_mb)",
    )  # SOTA-019
    cuts: str = _key(
        "equal",
        "pipeline: where stages are cut: equal (parameter bytes), graph (the smallest cut "
        "tensors) or balanced (measured compute per stage)",
    )  # SOTA-018
    schedule: str = _key(
        "1f1b", "pipeline: gpipe (every forward, then every backward) or 1f1b (alternating: fewer activations held)"
    )
    activation_budget_mb: float = _key(
        0.0, "pipeline with microbatches auto: MB (10^6 bytes) of activations a stage may hold; 0 = no limit"
    )


@dataclass
class OuterConfig:
    strategy: Spec | None = _key(
        None, "the strategy across islands, e.g. diloco:inner_steps=100 or local-sgd:every=8; none = no outer strategy"
    )
    authenticate: bool = _key(
        False,
        "every payload between islands carries an HMAC under the job's token "
        "(ISLANDS_TOKEN, made for the workers if unset): altered or replayed ones are refused",
    )


@dataclass
class MemoryConfig:
    activation_checkpointing: bool = _key(
        False, "recompute each transformer block in backward instead of keeping its activations"
    )  # SOTA-249
    precision: str = _key(
        "task",
        "task (the task's own choice: auto for hf-causal-lm, else fp32), fp32, bf16 "
        "(autocast forward; fp32 parameters and optimizer state) or auto (bf16 on CUDA, fp32 on "
        "the CPU); fsdp and pipeline take only task, fp32 there",
    )  # SOTA-118
    micro_batch: int = _key(
        0,
        "samples per forward/backward, gradients accumulated over the per-worker batch; 0 = the whole per-worker batch",
    )  # SOTA-031
    budget_mb: float = _key(
        0.0,
        "MB (10^6 bytes) a worker's step may use: > 0 picks the largest micro_batch whose "
        "measured memory fits; 0 = no budget",
    )  # SOTA-031


@dataclass
class CheckpointConfig:
    dir: str = _key("", 'root of the local-disk checkpoints; "" = <run_dir>/ckpt')
    every: int = _key(0, "steps between local-disk checkpoints; 0 = none (or the policy's choice)")
    policy: Spec | None = _key(
        None,
        "choose the local-disk interval from measurements: "
        'auto[:bound=0.035,mtbf_days=3748.25,devices=N]; "" = a fixed every',
    )  # SOTA-054/189
    memory_every: int = _key(0, "steps between in-memory snapshots (packed, checksummed, in the process); 0 = none")
    memory_peer: bool = _key(
        False, "rank r's in-memory snapshot is also held by rank (r+1) % n (needs memory_every)"
    )  # SOTA-057
    remote_dir: str = _key(
        "", 'a second checkpoint directory standing for remote storage (with remote_every); "" = none'
    )
    remote_every: int = _key(0, "steps between saves to remote_dir; 0 = none")
    keep: int = _key(3, "checkpoints kept per disk level (the newest always)")
    asynchronous: bool = _key(True, "snapshot, then write to disk in the background; off: blocking saves")  # SOTA-056
    share_replicas: bool = _key(
        True, "ranks > 0 reference rank 0's copy of tensors identical across ranks instead of writing them again"
    )
    resume: str = _key(
        "",
        "resume from a run dir (its ckpt/), a checkpoint dir (its newest intact step) or one step "
        'dir; "" = start fresh',
    )


@dataclass
class ElasticConfig:
    enabled: bool = _key(
        False, "workers may die and join while the job runs; needs an outer strategy (docs/membership.md)"
    )
    heartbeat_timeout: float = _key(3.0, "elastic: seconds without a heartbeat before a member counts as gone")
    # opt-in, so that a crash that repeats does not loop
    max_restarts: int = _key(
        0,
        "elastic: times the launcher starts a failed island again (it rejoins at a round "
        "boundary); 0 = the job goes on without it",
    )
    store: str = _key(
        "",
        "elastic: the job's store: \"\" = the job host's embedded one, or an etcd cluster "
        "etcd://HOST:PORT,... (etcds:// over TLS; docs/membership.md)",
    )


@dataclass
class OutputConfig:
    run_dir: str = _key(
        "",
        "where the run record goes (config.json, run.json, loss.png, live/, model/); "
        '"" = runs/<time>-<task>-w<workers>',
    )
    progress: bool = _key(
        True,
        "rank 0 draws a live progress bar on a terminal; off (CI, nohup): no bar, still its log lines, the summary "
        "table and where run.json, the model and the logs are",
    )
    save_model: bool = _key(
        True,
        "rank 0 writes the global model to RUN_DIR/model when the run ends (model.safetensors; a transformers "
        "task: its save_pretrained files and tokenizer; `islands export` reads it); off: only checkpoints keep it",
    )
    log: str = _key(
        "",
        "loggers besides run.json and live/*.jsonl, comma-separated: tensorboard, mlflow, wandb "
        '(docs/observe.md); "" = none',
    )


SECTIONS: dict[str, type] = {
    "task": TaskConfig,
    "train": TrainConfig,
    "world": WorldConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "memory": MemoryConfig,
    "checkpoint": CheckpointConfig,
    "elastic": ElasticConfig,
    "output": OutputConfig,
}


@dataclass
class JobConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    # ---- derived ----
    @property
    def workers_per_island(self) -> int:
        return self.world.workers // self.world.islands

    @property
    def batch_per_worker(self) -> int:
        return self.train.global_batch // self.world.workers

    @property
    def inner_strategy(self) -> str:
        if self.inner.strategy != "auto":
            return self.inner.strategy
        return "single" if self.world.workers == 1 else "ddp"

    def to_dict(self) -> dict:
        """Plain data for JSON: spec values as {"name", "args"} (Spec.to_json)."""
        return {
            section: {f.name: _plain(getattr(getattr(self, section), f.name)) for f in fields(SECTIONS[section])}
            for section in SECTIONS
        }

    def get(self, dotted: str):
        section, key = dotted.split(".", 1)
        return getattr(getattr(self, section), key)

    def fingerprint_fields(self) -> dict:
        """The fields that define the model's shape: a checkpoint must match these to load."""
        out = {
            "task": self.task.name,
            "d_model": self.task.d_model,
            "n_layers": self.task.n_layers,
            "n_heads": self.task.n_heads,
            "context": self.task.context,
            "hidden": self.task.hidden,
        }
        if self.task.name == "hf-causal-lm":  # only then: older runs' fingerprints stay as they were
            out.update(
                model=self.task.model,
                model_overrides=self.task.model_overrides,
                tokenizer=self.task.tokenizer,
                vocab_size=self.task.vocab_size,
            )
        return out


# Today's flat keys, each an alias of its section key (the CLI flags --ckpt-every etc. follow them).
FLAT: dict[str, str] = {
    "task": "task.name",
    "data": "task.data",
    "d_model": "task.d_model",
    "n_layers": "task.n_layers",
    "n_heads": "task.n_heads",
    "context": "task.context",
    "hidden": "task.hidden",
    "steps": "train.steps",
    "global_batch": "train.global_batch",
    "lr": "train.lr",
    "warmup": "train.warmup",
    "min_lr_ratio": "train.min_lr_ratio",
    "weight_decay": "train.weight_decay",
    "grad_clip": "train.grad_clip",
    "seed": "train.seed",
    "optimizer": "train.optimizer",
    "eval_every": "train.eval_every",
    "eval_batches": "train.eval_batches",
    "log_every": "train.log_every",
    "compile": "train.compile",
    "compile_backend": "train.compile_backend",
    "compile_mode": "train.compile_mode",
    "workers": "world.workers",
    "islands": "world.islands",
    "threads": "world.threads",
    "device": "world.device",
    "cross_backend": "world.cross_backend",
    "timeout": "world.timeout",
    "port": "world.port",
    "testbed": "world.testbed",
    "probe": "world.probe",
    "slowdown": "world.slowdown",
    "simulate": "world.simulate",
    "inner": "inner.strategy",
    "compress": "inner.compressor",
    "aggregate": "inner.aggregator",
    "attack": "inner.attack",
    "bucket_mb": "inner.bucket_mb",
    "hook_overlap": "inner.overlap",
    "wrap": "inner.wrap",
    "reshard": "inner.reshard",
    "prefetch": "inner.prefetch",
    "shard_group": "inner.shard_group",
    "shard_budget_mb": "inner.shard_budget_mb",
    "stages": "inner.stages",
    "microbatches": "inner.microbatches",
    "cuts": "inner.cuts",
    "pipeline_schedule": "inner.schedule",
    "activation_budget_mb": "inner.activation_budget_mb",
    "outer": "outer.strategy",
    "authenticate_payloads": "outer.authenticate",
    "activation_checkpointing": "memory.activation_checkpointing",
    "precision": "memory.precision",
    "micro_batch": "memory.micro_batch",
    "memory_budget_mb": "memory.budget_mb",
    "ckpt_dir": "checkpoint.dir",
    "ckpt_every": "checkpoint.every",
    "ckpt_policy": "checkpoint.policy",
    "ckpt_memory_every": "checkpoint.memory_every",
    "ckpt_memory_peer": "checkpoint.memory_peer",
    "ckpt_remote_dir": "checkpoint.remote_dir",
    "ckpt_remote_every": "checkpoint.remote_every",
    "ckpt_keep": "checkpoint.keep",
    "ckpt_async": "checkpoint.asynchronous",
    "ckpt_share_replicas": "checkpoint.share_replicas",
    "resume": "checkpoint.resume",
    "elastic": "elastic.enabled",
    "heartbeat_timeout": "elastic.heartbeat_timeout",
    "max_restarts": "elastic.max_restarts",
    "store": "elastic.store",
    "run_dir": "output.run_dir",
    "progress": "output.progress",
    "log": "output.log",
}


# The words that mean "nothing here" for a spec-valued key.
NOTHING = {
    "inner.compressor": ("", "none"),
    "inner.aggregator": ("", "mean"),
    "inner.attack": ("", "none"),
    "outer.strategy": ("", "none"),
    "checkpoint.policy": ("",),
}


def _plain(value):
    return value.to_json() if isinstance(value, Spec) else value


def keys() -> dict[str, str]:
    """Every dotted key (section.key) and its type name ("spec" for spec-valued keys)."""
    out = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            typ = f.type if isinstance(f.type, str) else f.type.__name__
            out[f"{section}.{f.name}"] = "spec" if typ.startswith("Spec") else typ
    return out


def descriptions() -> dict[str, str]:
    """Every dotted key's one-line description, as written beside its definition (`_key(default, help)`): the one
    source of `islands train --help` and of docs/config.md's key reference."""
    return {f"{section}.{f.name}": f.metadata.get("help", "") for section, cls in SECTIONS.items() for f in fields(cls)}


def default_text(dotted: str) -> str:
    """A key's default as `--help` and docs/config.md show it: repr of the value, a spec in its text form."""
    value = JobConfig().get(dotted)
    return repr(format_spec(value) if isinstance(value, Spec) else value)


REFERENCE_START = (
    "<!-- keys: made by islands.config.write_reference from the descriptions in config.py; do not edit -->"
)
REFERENCE_END = "<!-- /keys -->"


def reference_markdown() -> str:
    """The key reference of docs/config.md: one table per section, every key with its flat alias, default and
    description."""
    aliases: dict[str, list[str]] = {}
    for flat, dotted in FLAT.items():
        aliases.setdefault(dotted, []).append(flat)
    text = descriptions()
    lines = []
    for section in SECTIONS:
        lines += [f"### [{section}]", "", "| key | flat name | default | what it does |", "|---|---|---|---|"]
        for dotted in text:
            if dotted.split(".", 1)[0] == section:
                flat = ", ".join(f"`{a}`" for a in aliases.get(dotted, []))
                # markdown: | would end the cell, <name> would be read as an HTML tag
                cells = (
                    f"`{dotted}`",
                    flat,
                    f"`{default_text(dotted)}`",
                    text[dotted].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;"),
                )
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def write_reference(path: str | Path = "docs/config.md") -> bool:
    """Rewrite the key reference between REFERENCE_START and REFERENCE_END in `path` (run from the repository
    root after changing a key: python -c 'from islands.config import write_reference; write_reference()').
    Returns whether the file changed."""
    p = Path(path)
    old = p.read_text()
    head, start, rest = old.partition(REFERENCE_START)
    _, end, tail = rest.partition(REFERENCE_END)
    if not start or not end:
        raise ValueError(f"{p} has no {REFERENCE_START!r} ... {REFERENCE_END!r} block to fill")
    new = head + start + "\n\n" + reference_markdown() + "\n" + end + tail
    if new != old:
        p.write_text(new)
    return new != old


def parse_spec(key: str, value) -> Spec | None:
    """A spec-valued key's value as a Spec (from text, its JSON form, or a Spec), or None for "nothing"."""
    if value is None or isinstance(value, Spec):
        return value
    if isinstance(value, dict):
        return Spec.from_json(value)
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a spec string such as 'name:key=value', got {type(value).__name__} {value!r}")
    if value.strip().lower() in NOTHING.get(key, ("",)):
        return None
    try:
        return parse(value)
    except SpecError as e:
        raise ConfigError(f"{key}={value!r} is not a spec: {e}") from None


def canonical(key: str) -> str:
    """A flat alias or a dotted key -> the dotted key; ConfigError with suggestions when it is neither."""
    if key in FLAT:
        return FLAT[key]
    known = keys()
    if key in known:
        return key
    near = difflib.get_close_matches(key, list(known) + list(FLAT), n=3)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ConfigError(
        f"unknown config key {key!r}{hint}; keys are section.key ({', '.join(SECTIONS)}), "
        f"e.g. train.steps, or today's flat names such as steps; `islands train --help` lists them"
    )


def _coerce(key: str, value: Any, typ: str):
    if typ == "spec":
        return parse_spec(key, value)
    if typ == "dict":
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table of keys, got {type(value).__name__} {value!r}")
        return dict(value)
    want = {"int": int, "float": float, "str": str, "bool": bool}[typ]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (want is int and isinstance(value, bool)) or not isinstance(value, want):
        raise ConfigError(f"{key} must be {typ}, got {type(value).__name__} {value!r}")
    return value


def _flatten(values: dict, prefix: str = "") -> dict:
    """{"train": {"steps": 3}, "workers": 2} -> {"train.steps": 3, "workers": 2}; [task.options] stays a table."""
    out = {}
    for k, v in values.items():
        dotted = f"{prefix}{k}"
        if isinstance(v, dict) and dotted in SECTIONS:
            out.update(_flatten(v, dotted + "."))
        else:
            out[dotted] = v
    return out


def from_mapping(values: dict, base: JobConfig | None = None) -> JobConfig:
    """Apply overrides (sections as tables, dotted keys, or flat aliases) to a config; unknown keys and wrong
    types are ConfigErrors. A key given twice under two names is an error, not a silent pick."""
    cfg = dataclasses.replace(base or JobConfig())
    for section in SECTIONS:  # a fresh copy of each section: never mutate `base`
        setattr(cfg, section, dataclasses.replace(getattr(cfg, section)))
    types = keys()
    seen: dict[str, str] = {}
    for key, value in _flatten(values).items():
        if key.startswith("task.options.") and key.count(".") >= 2:
            cfg.task.options = {**cfg.task.options, key.split(".", 2)[2]: value}
            continue
        dotted = canonical(key)
        if dotted in seen:
            raise ConfigError(f"{dotted} is given twice (as {seen[dotted]!r} and {key!r}); give it once")
        seen[dotted] = key
        section, name = dotted.split(".", 1)
        setattr(getattr(cfg, section), name, _coerce(dotted, value, types[dotted]))
    return cfg


def parse_flag_value(key: str, text: str):
    """A flag's or --set's text in the key's type."""
    typ = keys().get(canonical(key))
    try:
        if typ == "spec":
            return text
        if typ == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if typ is None:
            raise KeyError(key)  # not a key: the message below, as for an unknown type
        return {"int": int, "float": float, "str": str}[typ](text)
    except (ValueError, KeyError):
        raise ConfigError(f"{key} must be {typ}, got {text!r}") from None


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def dump_json(cfg: JobConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2))


def load_json(path: Path) -> JobConfig:
    return from_mapping(json.loads(Path(path).read_text()))
