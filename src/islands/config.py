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
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from islands.spec import Spec, SpecError, parse


class ConfigError(ValueError):
    """A bad job configuration; the message says what is wrong and what would be right."""


@dataclass
class TaskConfig:
    name: str = "lm"  # lm: byte-level language model; digits: sklearn digits; or module:function (a user's Task)
    data: str = ""  # text file or directory for lm; "" = the Python standard library's source
    d_model: int = 128  # lm: width
    n_layers: int = 4
    n_heads: int = 4
    context: int = 128  # lm: bytes per sequence
    hidden: int = 128  # digits: MLP width
    model: str = "gpt2"  # hf-causal-lm: a family (gpt2 | llama | qwen2 | any causal-LM model_type) or a local directory
    model_overrides: str = ""  # hf-causal-lm: config keys, e.g. "n_layer=2,n_embd=64" (docs/hf-models.md)
    tokenizer: str = "auto"  # hf-causal-lm: auto | bpe | byte | path to a tokenizer.json
    vocab_size: int = 512  # hf-causal-lm: tokens of the BPE trained on the corpus (and the model's embedding rows)
    text_column: str = "text"  # hf-causal-lm with JSON lines / Parquet data (read through `datasets`): the text's column
    options: dict = field(default_factory=dict)  # free keys for a user's make_task (TOML [task.options])


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 32  # sequences (or images) per step summed over all workers
    lr: float = 3e-3
    warmup: int = 30  # linear warm-up steps, then cosine decay
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    optimizer: Spec | None = field(default_factory=lambda: Spec("adamw"))  # adamw | onebit-adam | split-adamw ...
    eval_every: int = 25
    eval_batches: int = 8
    log_every: int = 10


@dataclass
class WorldConfig:
    workers: int = 4
    islands: int = 1
    threads: int = 1  # torch threads per worker: one worker per core is the fair CPU comparison
    device: str = "auto"  # auto (cuda+nccl when every local worker gets its own GPU, else cpu+gloo) | cpu | cuda
    timeout: float = 120.0  # seconds a collective may block before the job is declared dead
    port: int = 0  # rendezvous port; 0 = pick a free one
    testbed: str = ""  # run each worker inside a host of this network testbed
    probe: bool = True  # measure the interconnect at start
    slowdown: str = ""  # e.g. "1=2.0": island 1 computes 2x slower (rank3=1.5: one rank); islands.faults.slowdown
    simulate: bool = False  # the islands as threads of ONE process on one device (islands.simulate, docs/simulate.md)


@dataclass
class InnerConfig:
    strategy: str = "auto"  # auto | single | ddp | zero1 | fsdp | pipeline
    compressor: Spec | None = None  # for the gradient exchange, e.g. powersgd:rank=4 (none: DDP's plain mean)
    aggregator: Spec | None = None  # e.g. median, nnm+krum:f=1 (mean: DDP's plain mean)
    attack: Spec | None = None  # to rehearse, e.g. sign-flip:count=1
    bucket_mb: float = 25.0  # DDP bucket size; torch's default 25 MB, Horovod's fusion buffer 64 MB (LIT-220)
    overlap: bool = True  # compressor: compress each bucket on a worker thread while backward goes on
    wrap: Spec | None = field(default_factory=lambda: Spec("block"))  # fsdp: model | block | params:N | split:K | graph:K
    reshard: bool = True  # fsdp: free gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2-like)
    prefetch: int = 0  # fsdp: gather N units ahead (SOTA-117); 0 = FSDP2's own
    shard_group: str = ""  # fsdp: ranks per sharding group: "" the island, "auto", or N (SOTA-119)
    shard_budget_mb: float = 0.0  # fsdp shard_group=auto: MiB of state per rank; 0 = device memory
    stages: int = 0  # pipeline: stages, one per worker of the island; 0 = workers per island
    microbatches: str = "auto"  # pipeline: micro-batches per step, or auto (SOTA-019 chooser)
    cuts: str = "equal"  # pipeline: equal (parameters) | graph (traced cut sizes) | balanced (SOTA-018)
    schedule: str = "1f1b"  # pipeline: gpipe | 1f1b
    activation_budget_mb: float = 0.0  # pipeline microbatches=auto: held-activation bytes per stage; 0 = no limit


@dataclass
class OuterConfig:
    strategy: Spec | None = None  # e.g. diloco:inner_steps=100 (None: one island, or no outer strategy)
    # every payload between islands carries an HMAC under the job's token (islands.runtime.payload_auth)
    authenticate: bool = False


@dataclass
class MemoryConfig:
    activation_checkpointing: bool = False  # recompute each block in backward (SOTA-249)
    # task | fp32 | bf16 | auto: bf16 = autocast forward, fp32 parameters and optimizer state (SOTA-118); auto = bf16
    # on CUDA, fp32 on the CPU; task = the task's own choice (Task.precision: fp32 for lm, digits and a user's task
    # unless it says otherwise, auto for hf-causal-lm), fp32 under fsdp and pipeline, which do not take it
    precision: str = "task"
    micro_batch: int = 0  # samples per forward/backward; 0 = the whole per-worker batch (SOTA-031)
    budget_mb: float = 0.0  # > 0: the largest micro_batch whose measured memory fits (SOTA-031)


@dataclass
class CheckpointConfig:
    dir: str = ""  # local-disk level; "" = <run_dir>/ckpt
    every: int = 0  # steps between local-disk checkpoints; 0 = none (or the policy's choice)
    policy: Spec | None = None  # None = a fixed `every`; auto[:bound=0.035,mtbf_days=3748.25,devices=N] (SOTA-054/189)
    memory_every: int = 0  # steps between in-memory snapshots; 0 = none
    memory_peer: bool = False  # the memory level also held by rank (r+1) % n (SOTA-057)
    remote_dir: str = ""  # a second directory standing for remote storage
    remote_every: int = 0  # steps between saves to remote_dir
    keep: int = 3  # checkpoints kept per disk level
    asynchronous: bool = True  # snapshot, then persist in the background (SOTA-056)
    share_replicas: bool = True  # ranks > 0 reference rank 0's copy of identical tensors, not write them
    resume: str = ""  # run dir, checkpoint dir or step dir to resume from


@dataclass
class ElasticConfig:
    enabled: bool = False  # workers may die and join (docs/membership.md)
    heartbeat_timeout: float = 3.0  # seconds without a heartbeat before a member counts as gone
    # times the launcher starts a failed island again (it rejoins at a round boundary); 0: the job goes on
    # without it, as before. Opt-in, so a crash that repeats does not loop (docs/membership.md)
    max_restarts: int = 0
    # where the job's store lives: "" the job host's embedded store (one machine), or an etcd cluster
    # etcd://HOST:PORT,HOST:PORT,... or etcds://... over TLS (no single point of failure; docs/membership.md;
    # a cluster with etcd's login: ISLANDS_ETCD_USER and ISLANDS_ETCD_PASSWORD_FILE in the environment)
    store: str = ""


@dataclass
class OutputConfig:
    run_dir: str = ""  # "" = runs/<time>-<task>-w<workers>
    progress: bool = True
    log: str = ""  # loggers besides run.json and live/: tensorboard, mlflow, wandb, comma-separated (docs/observe.md)


SECTIONS: dict[str, type] = {
    "task": TaskConfig, "train": TrainConfig, "world": WorldConfig, "inner": InnerConfig, "outer": OuterConfig,
    "memory": MemoryConfig, "checkpoint": CheckpointConfig, "elastic": ElasticConfig, "output": OutputConfig,
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
        return {section: {f.name: _plain(getattr(getattr(self, section), f.name)) for f in fields(SECTIONS[section])}
                for section in SECTIONS}

    def get(self, dotted: str):
        section, key = dotted.split(".", 1)
        return getattr(getattr(self, section), key)

    def fingerprint_fields(self) -> dict:
        """The fields that define the model's shape: a checkpoint must match these to load."""
        out = {"task": self.task.name, "d_model": self.task.d_model, "n_layers": self.task.n_layers,
               "n_heads": self.task.n_heads, "context": self.task.context, "hidden": self.task.hidden}
        if self.task.name == "hf-causal-lm":  # only then: older runs' fingerprints stay as they were
            out.update(model=self.task.model, model_overrides=self.task.model_overrides,
                       tokenizer=self.task.tokenizer, vocab_size=self.task.vocab_size)
        return out


# Today's flat keys, each an alias of its section key (the CLI flags --ckpt-every etc. follow them).
FLAT: dict[str, str] = {
    "task": "task.name", "data": "task.data", "d_model": "task.d_model", "n_layers": "task.n_layers",
    "n_heads": "task.n_heads", "context": "task.context", "hidden": "task.hidden",
    "steps": "train.steps", "global_batch": "train.global_batch", "lr": "train.lr", "warmup": "train.warmup",
    "min_lr_ratio": "train.min_lr_ratio", "weight_decay": "train.weight_decay", "grad_clip": "train.grad_clip",
    "seed": "train.seed", "optimizer": "train.optimizer", "eval_every": "train.eval_every",
    "eval_batches": "train.eval_batches", "log_every": "train.log_every",
    "workers": "world.workers", "islands": "world.islands", "threads": "world.threads", "device": "world.device",
    "timeout": "world.timeout", "port": "world.port", "testbed": "world.testbed", "probe": "world.probe",
    "slowdown": "world.slowdown", "simulate": "world.simulate",
    "inner": "inner.strategy", "compress": "inner.compressor", "aggregate": "inner.aggregator",
    "attack": "inner.attack", "bucket_mb": "inner.bucket_mb", "hook_overlap": "inner.overlap", "wrap": "inner.wrap",
    "reshard": "inner.reshard", "prefetch": "inner.prefetch", "shard_group": "inner.shard_group",
    "shard_budget_mb": "inner.shard_budget_mb", "stages": "inner.stages", "microbatches": "inner.microbatches",
    "cuts": "inner.cuts", "pipeline_schedule": "inner.schedule", "activation_budget_mb": "inner.activation_budget_mb",
    "outer": "outer.strategy", "authenticate_payloads": "outer.authenticate",
    "activation_checkpointing": "memory.activation_checkpointing", "precision": "memory.precision",
    "micro_batch": "memory.micro_batch", "memory_budget_mb": "memory.budget_mb",
    "ckpt_dir": "checkpoint.dir", "ckpt_every": "checkpoint.every", "ckpt_policy": "checkpoint.policy",
    "ckpt_memory_every": "checkpoint.memory_every", "ckpt_memory_peer": "checkpoint.memory_peer",
    "ckpt_remote_dir": "checkpoint.remote_dir", "ckpt_remote_every": "checkpoint.remote_every",
    "ckpt_keep": "checkpoint.keep", "ckpt_async": "checkpoint.asynchronous",
    "ckpt_share_replicas": "checkpoint.share_replicas", "resume": "checkpoint.resume",
    "elastic": "elastic.enabled", "heartbeat_timeout": "elastic.heartbeat_timeout",
    "max_restarts": "elastic.max_restarts", "store": "elastic.store",
    "run_dir": "output.run_dir", "progress": "output.progress", "log": "output.log",
}


# The words that mean "nothing here" for a spec-valued key.
NOTHING = {"inner.compressor": ("", "none"), "inner.aggregator": ("", "mean"), "inner.attack": ("", "none"),
           "outer.strategy": ("", "none"), "checkpoint.policy": ("",)}


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
    raise ConfigError(f"unknown config key {key!r}{hint}; keys are section.key ({', '.join(SECTIONS)}), "
                      f"e.g. train.steps, or today's flat names such as steps; `islands train --help` lists them")


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
    if want is int and isinstance(value, bool) or not isinstance(value, want):
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
