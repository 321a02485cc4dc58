"""One job config: a flat dataclass, loaded from TOML and flags, validated before any worker starts.

Every problem is reported as a ConfigError naming the key, what was given, and what would be valid;
the CLI turns it into exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path


class ConfigError(ValueError):
    """A bad job configuration; the message says what is wrong and what would be right."""


_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit)$")


@dataclass
class TrainConfig:
    # what to learn
    task: str = "lm"  # lm: byte-level language model; digits: sklearn digits classification
    data: str = ""  # text file or directory for task=lm; "" = the Python standard library's source
    # model (lm: causal byte transformer; digits: MLP)
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 128
    hidden: int = 128  # digits MLP width
    # optimisation
    steps: int = 200
    global_batch: int = 32  # sequences (or images) per step summed over all workers
    lr: float = 3e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    # world
    workers: int = 4
    islands: int = 1
    threads: int = 1  # torch threads per worker: one worker per core is the fair CPU comparison
    device: str = "auto"  # auto (cuda+nccl when every local worker gets its own GPU, else cpu+gloo) | cpu | cuda
    inner: str = "auto"  # auto | single | ddp | zero1 | fsdp | pipeline
    outer: str = ""  # "" or a spec such as "diloco:inner_steps=100"
    compress: str = "none"  # compressor spec for the inner gradient exchange
    aggregate: str = "mean"  # aggregator spec
    attack: str = ""  # attack spec, e.g. "sign-flip:count=2"
    optimizer: str = "adamw"  # adamw | onebit-adam[:warmup=N] | naive-compressed-adam[:warmup=N] | split-adamw[:...] (islands.compress.optim)
    bucket_mb: float = 25.0  # DDP bucket size; torch's default 25 MB, Horovod's fusion buffer 64 MB (LIT-220)
    hook_overlap: bool = True  # compress=...: compress each bucket on a worker thread while backward goes on, or inside the hook
    wrap: str = "block"  # inner=fsdp: model | block | params:N | split:K | graph:K (islands.sync.wrap_policy)
    reshard: bool = True  # inner=fsdp: free gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2-like)
    prefetch: int = 0  # inner=fsdp: gather N units ahead, forward and backward (SOTA-117); 0 = FSDP2's own
    shard_group: str = ""  # inner=fsdp: ranks per sharding group: "" the island, "auto" sized from memory, N (SOTA-119)
    shard_budget_mb: float = 0.0  # shard_group=auto: MiB of parameter+gradient+optimizer state per rank; 0 = device memory
    # inner=pipeline: the island's workers are the stages of one pipeline (islands.parallel.pipeline)
    stages: int = 0  # pipeline stages, one per worker of the island; 0 = workers per island
    microbatches: str = "auto"  # micro-batches per step, or auto: the SOTA-019 chooser
    cuts: str = "equal"  # stage boundaries: equal (parameters) | graph (traced cut sizes) | balanced (SOTA-018)
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b
    activation_budget_mb: float = 0.0  # microbatches=auto: held-activation bytes per stage allowed; 0 = no limit
    # memory (islands.memory; docs/memory.md)
    activation_checkpointing: bool = False  # lm: recompute each block in backward instead of holding it (SOTA-249)
    precision: str = "fp32"  # fp32 | bf16: autocast forward, fp32 parameters and optimizer state (SOTA-118)
    micro_batch: int = 0  # samples per forward/backward; 0 = the whole per-worker batch, else accumulate (SOTA-031)
    memory_budget_mb: float = 0.0  # > 0: pick the largest micro_batch whose measured memory fits (SOTA-031)
    # runtime
    timeout: float = 120.0  # seconds a collective may block before the job is declared dead
    port: int = 0  # rendezvous port; 0 = pick a free one
    testbed: str = ""  # run each worker inside a host of this network testbed
    probe: bool = True  # measure the interconnect at start
    elastic: bool = False  # workers may die and join (islands.runtime.elastic; docs/membership.md)
    heartbeat_timeout: float = 3.0  # elastic: seconds without a heartbeat before a member counts as gone
    # evaluation and output
    eval_every: int = 25
    eval_batches: int = 8
    log_every: int = 10
    run_dir: str = ""  # "" = runs/<timestamp>
    progress: bool = True
    # checkpointing
    ckpt_dir: str = ""  # local-disk level; "" = <run_dir>/ckpt
    ckpt_every: int = 0  # steps between local-disk checkpoints; 0 = none (or ckpt_policy's choice)
    ckpt_policy: str = ""  # "" = fixed ckpt_every; "auto[:bound=0.035,mtbf_days=3748.25,devices=N]" (SOTA-054/189)
    ckpt_memory_every: int = 0  # steps between in-memory snapshots; 0 = none
    ckpt_memory_peer: bool = False  # memory level also held by rank (r+1) % n (SOTA-057)
    ckpt_remote_dir: str = ""  # a second directory standing for remote storage; "" = none
    ckpt_remote_every: int = 0  # steps between saves to ckpt_remote_dir
    ckpt_keep: int = 3  # checkpoints kept per disk level
    ckpt_async: bool = True  # snapshot, then persist in the background (SOTA-056)
    ckpt_share_replicas: bool = True  # ranks > 0 reference rank 0's copy of identical tensors, not write them
    resume: str = ""  # run dir, checkpoint dir or step dir to resume from (islands.checkpoint.resume)
    extra: dict = field(default_factory=dict)  # experiment-only knobs; never set from TOML

    # ---- derived ----
    @property
    def workers_per_island(self) -> int:
        return self.workers // self.islands

    @property
    def batch_per_worker(self) -> int:
        return self.global_batch // self.workers

    @property
    def inner_strategy(self) -> str:
        if self.inner != "auto":
            return self.inner
        return "single" if self.workers == 1 else "ddp"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint_fields(self) -> dict:
        """The fields that define model shape: a checkpoint must match these to load."""
        keys = ("task", "d_model", "n_layers", "n_heads", "context", "hidden")
        return {k: getattr(self, k) for k in keys}


_CHOICES = {"task": ("lm", "digits"), "inner": ("auto", "single", "ddp", "zero1", "fsdp", "pipeline"),
            "device": ("auto", "cpu", "cuda")}


def _field_types() -> dict[str, type]:
    return {f.name: f.type for f in fields(TrainConfig) if f.name != "extra"}


def _coerce(key: str, value, typ: str):
    want = {"int": int, "float": float, "str": str, "bool": bool}[typ]
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is int and isinstance(value, bool) or not isinstance(value, want):
        raise ConfigError(f"{key} must be {typ}, got {type(value).__name__} {value!r}")
    return value


def from_mapping(values: dict, base: TrainConfig | None = None) -> TrainConfig:
    """Apply a flat mapping of overrides to a config, rejecting unknown keys and wrong types."""
    types = _field_types()
    cfg = dataclasses.replace(base or TrainConfig())
    for key, value in values.items():
        if key not in types:
            near = difflib.get_close_matches(key, types, n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; valid keys: {', '.join(sorted(types))}")
        setattr(cfg, key, _coerce(key, value, types[key]))
    return cfg


def parse_flag_value(key: str, text: str):
    """Turn a --set key=value string into the key's type."""
    types = _field_types()
    if key not in types:
        return text  # from_mapping reports the unknown key
    typ = types[key]
    try:
        if typ == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        return {"int": int, "float": float, "str": str}[typ](text)
    except ValueError:
        raise ConfigError(f"{key} must be {typ}, got {text!r}") from None


def load_toml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    nested = [k for k, v in data.items() if isinstance(v, dict)]
    if nested:
        raise ConfigError(f"config file {str(p)!r}: tables are not used, put keys at top level (found [{nested[0]}])")
    return data


def validate(cfg: TrainConfig) -> TrainConfig:
    """Reject impossible combinations before any worker starts."""
    for key, choices in _CHOICES.items():
        if getattr(cfg, key) not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {getattr(cfg, key)!r}")
    if cfg.device == "cuda":
        import os

        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers))  # torchrun sets it per host
        if gpus < local_workers:
            raise ConfigError(f"device=cuda needs one GPU per local worker: workers={cfg.workers}, "
                              f"{gpus} CUDA device(s) visible; use device=cpu or auto")
    positive = ("d_model", "n_layers", "n_heads", "context", "hidden", "steps", "global_batch",
                "workers", "islands", "threads", "eval_batches", "log_every")
    for key in positive:
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1; got {getattr(cfg, key)}")
    if cfg.lr <= 0:
        raise ConfigError(f"lr must be > 0; got {cfg.lr}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ConfigError(f"min_lr_ratio must be in [0, 1]; got {cfg.min_lr_ratio}")
    if cfg.warmup < 0 or cfg.eval_every < 0 or cfg.ckpt_every < 0:
        raise ConfigError("warmup, eval_every and ckpt_every must be >= 0")
    if cfg.timeout <= 0:
        raise ConfigError(f"timeout must be > 0 seconds; got {cfg.timeout}")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"port must be 0 (pick a free one) or 1..65535; got {cfg.port}")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})")
    if cfg.workers % cfg.islands:
        raise ConfigError(f"workers ({cfg.workers}) must be divisible by islands ({cfg.islands})")
    if cfg.global_batch % cfg.workers:
        raise ConfigError(
            f"global_batch ({cfg.global_batch}) must be divisible by workers ({cfg.workers}); "
            f"try global_batch={cfg.workers * max(1, cfg.global_batch // cfg.workers)}"
        )
    if cfg.prefetch < 0 or cfg.shard_budget_mb < 0:
        raise ConfigError(f"prefetch and shard_budget_mb must be >= 0; got {cfg.prefetch}, {cfg.shard_budget_mb}")
    if cfg.inner == "single" and cfg.workers_per_island > 1:
        raise ConfigError("inner=single needs one worker per island; use inner=ddp or auto")
    if cfg.task == "digits" and cfg.data:
        raise ConfigError("data applies to task=lm only; digits ships with scikit-learn")
    if cfg.data and not Path(cfg.data).exists():
        raise ConfigError(f"data path {cfg.data!r} does not exist; give a text file or a directory")
    if cfg.testbed and cfg.port:
        raise ConfigError("port is chosen inside the testbed; leave port=0 with testbed")
    _validate_specs(cfg)
    _validate_memory(cfg)
    _validate_checkpointing(cfg)
    if cfg.elastic:
        from islands.runtime.elastic_worker import check_elastic_config

        try:
            check_elastic_config(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return cfg


def _validate_checkpointing(cfg: TrainConfig) -> None:
    """Checkpoint settings, and that a resume checkpoint exists and fits this model (islands.checkpoint)."""
    from islands.checkpoint.driver import check_checkpoint_config

    try:
        check_checkpoint_config(cfg)
        if cfg.resume:
            from islands.checkpoint.resume import check_resume

            check_resume(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_memory(cfg: TrainConfig) -> None:
    """Precision, micro-batch and memory budget settings (islands.memory.build)."""
    from islands.memory.build import check_memory_config

    try:
        check_memory_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _validate_specs(cfg: TrainConfig) -> None:
    """Spec strings are parsed by their own packages, which raise ValueError with the valid choices."""
    from islands.sync.registry import check_specs

    try:
        check_specs(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def dump_json(cfg: TrainConfig, path: Path) -> None:
    path.write_text(json.dumps(cfg.to_dict(), indent=2))


def load_json(path: Path) -> TrainConfig:
    data = json.loads(Path(path).read_text())
    extra = data.pop("extra", {})
    cfg = from_mapping(data)
    cfg.extra = extra
    return cfg
