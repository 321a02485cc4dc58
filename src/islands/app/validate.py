"""Validate a job config before any worker starts: one table of rules, each with its message.

`validate(cfg)` returns the config or raises ConfigError listing every problem (the CLI exits 2). RULES is
the table: each rule is a function of the config returning None (or []) when the config is fine, or the
message(s) saying what is wrong and what would be right, and names the rules whose values it reads (it is
skipped when one of them failed). A rule about one component (the spec strings, checkpoint settings, a resume
directory, what an outer strategy or the checkpoint driver refuses in an elastic job) asks that component,
which owns the rule and its message, and reports its ValueError; this module keeps the rules that span
config sections.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from islands.aggregate.registry import AGGREGATORS
from islands.app.build import build_step_fn, build_task, checkpoint_settings, fingerprint
from islands.checkpoint.policy.driver import CheckpointDriver
from islands.checkpoint.policy.resume import check_resume
from islands.checkpoint.policy.settings import POLICIES
from islands.compress.optim import OPTIMIZERS
from islands.compress.registry import COMPRESSORS
from islands.config import ConfigError, JobConfig
from islands.data.batches import compute_loss
from islands.data.source import batch_source
from islands.faults.attacks import ATTACKS
from islands.faults.slowdown import check_slowdown, parse_slowdown
from islands.memory.step import PRECISIONS
from islands.observe.backends import missing_packages, parse_logger_names
from islands.parallel.pipeline.chooser import divisors
from islands.parallel.pipeline.cuts import parse_cuts
from islands.parallel.pipeline.hf_pieces import causal_lm_pieces, is_causal_lm, tied_embeddings
from islands.parallel.pipeline.schedule import SCHEDULES
from islands.parallel.pipeline.strategy import parse_microbatches
from islands.runtime.compiled import Compile, check_backend
from islands.runtime.contracts import ServedParticipant
from islands.runtime.elastic.etcd_store import EtcdAddress, EtcdLogin, EtcdTLS
from islands.runtime.launch.ranks import LaunchError, load_testbed
from islands.runtime.world import CROSS_BACKENDS, World, islands_may_share
from islands.spec import Spec, format as format_spec
from islands.sync.outer import make_outer, parse_outer
from islands.sync.shard_group import check_group, parse_shard_group
from islands.sync.wrap_policy import WRAP_POLICIES
from islands.tasks import hf_lm as hf, is_user_task

INNER = ("auto", "single", "ddp", "zero1", "fsdp", "pipeline")
DEVICES = ("auto", "cpu", "cuda")
POSITIVE = (
    "task.d_model",
    "task.n_layers",
    "task.n_heads",
    "task.context",
    "task.hidden",
    "train.steps",
    "train.global_batch",
    "world.workers",
    "world.islands",
    "world.threads",
    "train.eval_batches",
    "train.log_every",
)


def _compress(cfg) -> bool:
    return cfg.inner.compressor is not None


def _robust(cfg) -> bool:
    return cfg.inner.aggregator is not None or cfg.inner.attack is not None


def _communicates(cfg) -> bool:
    return cfg.train.optimizer is not None and OPTIMIZERS.build(cfg.train.optimizer).communicates


def _optimizer_text(cfg: JobConfig) -> str:
    """train.optimizer as text, where the rules name it (after _communicates or a look at its name: it is set)."""
    assert cfg.train.optimizer is not None
    return format_spec(cfg.train.optimizer)


# ---- the rules ---------------------------------------------------------------------------------------
def choices(cfg: JobConfig) -> list[str]:
    found = []
    if cfg.task.name not in ("lm", "digits", hf.NAME) and not is_user_task(cfg.task.name):
        found.append(
            f"task.name must be lm, digits, {hf.NAME} or module:function (a user's make_task); got {cfg.task.name!r}"
        )
    if cfg.inner.strategy not in INNER:
        found.append(f"inner.strategy must be one of {', '.join(INNER)}; got {cfg.inner.strategy!r}")
    if cfg.world.device not in DEVICES:
        found.append(f"world.device must be one of {', '.join(DEVICES)}; got {cfg.world.device!r}")
    if cfg.world.cross_backend not in CROSS_BACKENDS:
        found.append(f"world.cross_backend must be one of {', '.join(CROSS_BACKENDS)}; got {cfg.world.cross_backend!r}")
    return found


def elastic_on_gpus(cfg: JobConfig) -> str | None:
    """An elastic job on GPUs: islands of one worker (runtime.world.elastic_device)."""
    if cfg.elastic.enabled and cfg.world.device == "cuda" and cfg.workers_per_island > 1:
        return (
            f"an elastic job on GPUs (world.device=cuda) needs islands of one worker; got {cfg.workers_per_island} "
            "per island (its workers meet over gloo inside the island, kept on the CPU in this version): set "
            "workers = islands, or world.device=cpu"
        )
    return None


def cross_backend(cfg: JobConfig) -> str | None:
    """world.cross_backend=nccl: only where the islands are one fixed NCCL world (resolve_cross_backend)."""
    w = cfg.world
    if w.cross_backend != "nccl":
        return None
    if w.device == "cpu":
        return "world.cross_backend=nccl needs world.device=cuda (or auto on GPUs); a CPU job exchanges over gloo"
    if cfg.elastic.enabled:
        return (
            "world.cross_backend=nccl: an elastic job exchanges over gloo (NCCL cannot follow members that come "
            "and go); use auto or gloo"
        )
    if w.simulate:
        return "world.cross_backend=nccl: simulated islands are threads of one process and exchange in memory"
    return None


def positive(cfg: JobConfig) -> list[str]:
    found = [f"{key} must be >= 1; got {cfg.get(key)}" for key in POSITIVE if cfg.get(key) < 1]
    if cfg.train.lr <= 0:
        found.append(f"train.lr must be > 0; got {cfg.train.lr}")
    if not 0 <= cfg.train.min_lr_ratio <= 1:
        found.append(f"train.min_lr_ratio must be in [0, 1]; got {cfg.train.min_lr_ratio}")
    if cfg.train.warmup < 0 or cfg.train.eval_every < 0:
        found.append("train.warmup and train.eval_every must be >= 0")
    if cfg.world.timeout <= 0:
        found.append(f"world.timeout must be > 0 seconds; got {cfg.world.timeout}")
    if not 0 <= cfg.world.port <= 65535:
        found.append(f"world.port must be 0 (pick a free one) or 1..65535; got {cfg.world.port}")
    if cfg.inner.prefetch < 0 or cfg.inner.shard_budget_mb < 0:
        found.append(
            f"inner.prefetch and inner.shard_budget_mb must be >= 0; got {cfg.inner.prefetch}, "
            f"{cfg.inner.shard_budget_mb}"
        )
    return found


def device_has_gpus(cfg: JobConfig) -> str | None:
    """world.device=cuda: a GPU per local worker, or islands that may share the GPUs (runtime.world.plan_groups:
    NCCL inside each island of at most as many workers as GPUs, gloo across)."""
    if cfg.world.device != "cuda":
        return None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world.workers))  # torchrun sets it per host
    if cfg.world.simulate:
        local = 1  # every simulated island on the one device
    w = cfg.world
    if gpus < local and not islands_may_share(w.islands, w.workers, gpus, w.cross_backend):
        share = (
            f", or islands that share the GPUs (world.islands > 1 of at most {gpus} worker(s) each, "
            "world.cross_backend gloo or auto)"
            if gpus
            else ""
        )
        return (
            f"world.device=cuda needs one GPU per local worker: workers={cfg.world.workers}, {gpus} CUDA "
            f"device(s) visible; use world.device=cpu or auto{share}"
        )
    return None


def shapes(cfg: JobConfig) -> list[str]:
    found = []
    if cfg.task.d_model % cfg.task.n_heads:
        found.append(f"task.d_model ({cfg.task.d_model}) must be divisible by task.n_heads ({cfg.task.n_heads})")
    if cfg.world.workers % cfg.world.islands:
        found.append(f"world.workers ({cfg.world.workers}) must be divisible by world.islands ({cfg.world.islands})")
    if cfg.train.global_batch % cfg.world.workers:
        found.append(
            f"train.global_batch ({cfg.train.global_batch}) must be divisible by world.workers "
            f"({cfg.world.workers}); try global_batch="
            f"{cfg.world.workers * max(1, cfg.train.global_batch // cfg.world.workers)}"
        )
    if cfg.inner.strategy == "single" and cfg.workers_per_island > 1:
        found.append("inner.strategy=single needs one worker per island; use ddp or auto")
    return found


def data(cfg: JobConfig) -> str | None:
    if cfg.task.name == "digits" and cfg.task.data:
        return "task.data applies to task lm only; digits ships with scikit-learn"
    if (
        cfg.task.data
        and not Path(cfg.task.data).exists()
        and not (cfg.task.name == hf.NAME and any(c in cfg.task.data for c in "*?["))
    ):  # hf-causal-lm reads glob patterns (its rule checks them)
        return f"task.data path {cfg.task.data!r} does not exist; give a text file or a directory"
    return None


def testbed(cfg: JobConfig) -> str | None:
    if not cfg.world.testbed:
        return None
    if cfg.world.port:
        return "world.port is chosen inside the testbed; leave port=0 with a testbed"
    try:
        load_testbed(cfg.world.testbed)  # it exists and is up, here and under torchrun alike
    except LaunchError as e:
        return str(e)
    return None


def specs(cfg: JobConfig) -> list[str]:
    """Every spec value names a known constructor with valid arguments (each registry's SpecError lists them)."""
    inner, found = cfg.inner, []

    def ask(key: str, check: Callable[[], object]) -> bool:
        try:
            check()
        except ValueError as e:
            found.append(f"{key}: {e}")
            return False
        return True

    def attack_fits(spec: Spec) -> object:
        return ATTACKS.build(spec).ranks_in(cfg.world.workers)

    for key, registry, value in (
        ("inner.compressor", COMPRESSORS, inner.compressor),
        ("inner.aggregator", AGGREGATORS, inner.aggregator),
        ("inner.attack", ATTACKS, inner.attack),
        ("train.optimizer", OPTIMIZERS, cfg.train.optimizer),
        ("inner.wrap", WRAP_POLICIES, inner.wrap),
        ("checkpoint.policy", POLICIES, cfg.checkpoint.policy),
    ):
        if value is None:
            if key in ("train.optimizer", "inner.wrap"):
                found.append(f"{key} needs a value; e.g. {'adamw' if key == 'train.optimizer' else 'block'}")
            continue
        # the constructors' own checks too, before any worker starts; an attack's count/ranks fit the world
        ask(key, partial(attack_fits, value) if key == "inner.attack" else partial(registry.build, value))
    ask("inner.shard_group", lambda: parse_shard_group(inner.shard_group))
    ask("inner.cuts", lambda: parse_cuts(inner.cuts))
    ask("inner.microbatches", lambda: parse_microbatches(inner.microbatches))
    if inner.schedule not in SCHEDULES:
        found.append(f"inner.schedule (pipeline) must be one of {', '.join(SCHEDULES)}; got {inner.schedule!r}")
    outer = cfg.outer.strategy
    if outer is not None and ask("outer.strategy", lambda: parse_outer(outer)):
        warm = parse_outer(outer).params.get("warm_start", 0)
        if warm >= cfg.train.steps:
            found.append(
                f"outer warm_start ({warm}) must be < train.steps ({cfg.train.steps}) so that some steps "
                "are left for the outer rounds"
            )
    return found


def slowdown(cfg: JobConfig) -> str | None:
    """world.slowdown names islands and ranks the job has; the pipeline runs its own step, which is not slowed."""
    if not cfg.world.slowdown:
        return None
    parsed = parse_slowdown(cfg.world.slowdown)
    check_slowdown(parsed, cfg.world.islands, cfg.world.workers)
    if parsed and cfg.inner_strategy == "pipeline":
        return "world.slowdown slows the forward and backward step, which inner.strategy=pipeline runs itself; drop one"
    return None


def adaptive_rounds(cfg: JobConfig) -> str | None:
    """DiLoCo adapt=speed|deadline lets a slower island skip counted steps to its round's end: every collective keyed
    on the step count (checkpoint saves) must fall on round ends, multiples of H."""
    if cfg.outer.strategy is None:
        return None
    spec = parse_outer(cfg.outer.strategy)
    if spec.params.get("adapt", "none") == "none":
        return None
    h, c = spec.params["inner_steps"], cfg.checkpoint
    warm = spec.params.get("warm_start", 0)
    if warm % h and (c.every or c.memory_every or c.remote_every):
        return (
            f"outer adapt={spec.params['adapt']} with checkpoints: warm_start ({warm}) must be a multiple of "
            f"inner_steps ({h}) so that round ends fall on checkpoint steps"
        )
    if c.policy is not None:
        return (
            f"outer adapt={spec.params['adapt']} needs checkpoint intervals that are multiples of inner_steps "
            f"({h}); checkpoint.policy chooses them at run time: give checkpoint.every instead"
        )
    for key in ("every", "memory_every", "remote_every"):
        if getattr(c, key) % h:
            return (
                f"outer adapt={spec.params['adapt']}: checkpoint.{key}={getattr(c, key)} must be a multiple of "
                f"inner_steps ({h}), where every island is at a round's end; e.g. {h * max(1, getattr(c, key) // h)}"
            )
    if cfg.elastic.enabled:
        return f"outer adapt={spec.params['adapt']} is not supported with elastic membership yet; use adapt=none"
    return None


def optimizer_exchange(cfg: JobConfig) -> str | None:
    if _communicates(cfg) and (_compress(cfg) or _robust(cfg)):
        return (
            f"train.optimizer={_optimizer_text(cfg)!r} averages 1-bit momentum itself, so there is no gradient "
            "exchange to compress or aggregate; leave inner.compressor='none', inner.aggregator='mean', "
            "inner.attack=''"
        )
    if _compress(cfg) and _robust(cfg):
        return (
            "inner.compressor and a robust inner.aggregator/attack cannot be combined in the per-step exchange; "
            "use one of them, or robust aggregation in an outer strategy"
        )
    return None


def islands_need_outer(cfg: JobConfig) -> str | None:
    if (
        cfg.world.islands > 1 and cfg.outer.strategy is None and cfg.inner_strategy != "fsdp"
    ):  # fsdp: HSDP across islands
        return (
            f"world.islands={cfg.world.islands} needs an outer strategy to meet across islands, e.g. "
            "outer.strategy='diloco:inner_steps=100' or 'local-sgd:every=8'; or use islands=1"
        )
    if (
        cfg.outer.strategy is not None
        and cfg.world.islands == 1
        and cfg.world.workers > 1
        and cfg.inner_strategy == "ddp"
    ):
        return (
            "an outer strategy acts across islands, but world.islands=1 puts every worker in one island; "
            f"set islands={cfg.world.workers} (one worker per island) or a divisor of workers"
        )
    return None


def sharding(cfg: JobConfig) -> str | None:
    inner, kind = cfg.inner, cfg.inner_strategy
    group = parse_shard_group(inner.shard_group)
    if kind == "zero1" and (_compress(cfg) or _robust(cfg) or _communicates(cfg)):
        return (
            "inner.strategy=zero1 partitions an ordinary optimizer over DDP's plain mean; compressor, aggregator, "
            "attack and 1-bit optimizers are wired for inner.strategy=ddp only"
        )
    if kind != "fsdp":
        if group != "" or inner.prefetch or inner.shard_budget_mb:
            return (
                f"inner.shard_group={inner.shard_group!r}, inner.shard_budget_mb and inner.prefetch="
                f"{inner.prefetch} apply to inner.strategy=fsdp only"
            )
        return None
    if isinstance(group, int):
        check_group(group, cfg.world.workers)
    if inner.shard_budget_mb and group != "auto":
        return "inner.shard_budget_mb is the budget of shard_group='auto'; set shard_group='auto' or drop it"
    clash = [
        f"{k}={format_spec(v)!r}"
        for k, v in (("compressor", inner.compressor), ("aggregator", inner.aggregator), ("attack", inner.attack))
        if v is not None
    ]
    if _communicates(cfg) or (cfg.train.optimizer is not None and cfg.train.optimizer.name == "muon"):
        clash.append(f"optimizer={_optimizer_text(cfg)!r}")  # muon orthogonalises whole matrices
    if clash:  # FSDP owns its reduce-scatter; these act on a replicated gradient or a full local model
        return (
            f"inner.strategy=fsdp shards gradients and parameters, so it does not combine with {', '.join(clash)}; "
            "use inner.strategy=ddp for those, or drop them"
        )
    return fsdp_outer(cfg) if cfg.outer.strategy is not None else None


def fsdp_outer(cfg: JobConfig) -> str | None:
    """inner.strategy=fsdp with an outer strategy: each worker exchanges its own shard with the workers holding the
    same shard on the other islands, which needs every island sharded the same way over its own workers. The
    strategy itself says whether it runs on shards (OuterStrategy.sharded_refusal): built here, as parse_outer does."""
    assert cfg.outer.strategy is not None  # asked only of a job with an outer strategy
    why = make_outer(cfg.outer.strategy, warmup=cfg.train.warmup).sharded_refusal()
    if why:
        return f"inner.strategy=fsdp shards the parameters: {why}; or use inner.strategy=ddp"
    if parse_shard_group(cfg.inner.shard_group) != "":
        return (
            f"inner.shard_group={cfg.inner.shard_group!r}: under an outer strategy fsdp shards over each island's "
            "own workers (the outer exchange pairs the workers holding the same shard); leave shard_group ''"
        )
    return None


def memory(cfg: JobConfig) -> str | None:
    m = cfg.memory
    if m.precision != "task" and m.precision not in PRECISIONS:
        return (
            f"memory.precision must be one of task (the task's own choice, the default), "
            f"{', '.join(PRECISIONS)}; got {m.precision!r}"
        )
    per_worker = cfg.batch_per_worker
    if m.micro_batch < 0:
        return f"memory.micro_batch must be >= 0 (0 = the whole per-worker batch); got {m.micro_batch}"
    if m.micro_batch > per_worker:
        return (
            f"memory.micro_batch ({m.micro_batch}) exceeds the per-worker batch global_batch/workers = "
            f"{per_worker}; use 0 (whole batch) or 1..{per_worker}"
        )
    if m.budget_mb < 0:
        return f"memory.budget_mb must be >= 0 (0 = no budget); got {m.budget_mb}"
    if m.budget_mb and m.micro_batch:
        return f"memory.budget_mb={m.budget_mb} chooses micro_batch itself; set micro_batch=0 or drop the budget"
    if m.activation_checkpointing and cfg.task.name == "digits":
        return (
            "memory.activation_checkpointing recomputes transformer blocks; the digits MLP holds too little to "
            "matter (use it with task lm or a model of yours that supports it)"
        )
    on = m.activation_checkpointing or m.precision not in ("fp32", "task") or m.micro_batch or m.budget_mb
    if cfg.inner_strategy in ("fsdp", "pipeline") and on:
        return (
            f"memory settings (activation_checkpointing, precision, micro_batch, budget_mb) are not yet wired "
            f"through inner.strategy={cfg.inner_strategy} (FSDP has its own mixed precision; a pipeline owns its "
            f"forward, backward and micro-batches); use inner.strategy=ddp or single with them"
        )
    if m.budget_mb:  # sizing is a few small passes on the CPU: a budget too small fails before any worker starts
        with torch.random.fork_rng():
            build_step_fn(cfg, build_task(cfg), None, World.single())  # AdamW-sized state before one exists
    return None


def compiled(cfg: JobConfig) -> str | None:
    """train.compile: a mode torch knows (always), and when on, a backend this machine can run and a step islands
    itself runs (a pipeline's stages run their own forward and backward)."""
    t = cfg.train
    Compile(t.compile_backend or "inductor", t.compile_mode)  # its ValueError names the modes
    if not t.compile:
        return None
    if cfg.inner_strategy == "pipeline":
        return (
            "train.compile compiles the model's forward and backward, which a pipeline's stages run themselves; "
            "leave it off with inner.strategy=pipeline"
        )
    cpu = cfg.world.device == "cpu" or (cfg.world.device == "auto" and not torch.cuda.is_available())
    check_backend(t.compile_backend, "cpu" if cpu else "cuda")
    return None


def pipeline(cfg: JobConfig) -> str | None:
    inner = cfg.inner
    if inner.stages < 0 or inner.activation_budget_mb < 0:
        return "inner.stages and inner.activation_budget_mb must be >= 0 (0: one stage per worker / no budget)"
    if cfg.inner_strategy != "pipeline":
        return None
    if is_user_task(cfg.task.name):
        return "inner.strategy=pipeline cuts the built-in models into pieces; it does not take a user's task yet"
    k = inner.stages or cfg.workers_per_island
    if cfg.task.name == hf.NAME:
        problem = _hf_pipeline(cfg, k)
        if problem:
            return problem
    if k != cfg.workers_per_island:
        return (
            f"inner.stages={k} needs one worker per stage: set workers={k * cfg.world.islands} "
            f"(with islands={cfg.world.islands}) or stages={cfg.workers_per_island}"
        )
    pieces = cfg.task.n_layers + 2 if cfg.task.name == "lm" else 3
    if k > pieces and cfg.task.name != hf.NAME:
        return (
            f"inner.stages={k} but the {cfg.task.name} model has only {pieces} pieces to cut between "
            f"({'n_layers + 2' if cfg.task.name == 'lm' else 'three layers'}); use stages <= {pieces}"
        )
    m = parse_microbatches(inner.microbatches)
    batch = cfg.train.global_batch // cfg.world.islands
    if isinstance(m, int) and batch % m:  # an int, or "auto"
        return (
            f"inner.microbatches={m} does not divide the pipeline's batch of {batch}; choose one of "
            f"{divisors(batch)} or 'auto'"
        )
    c, mem = cfg.checkpoint, cfg.memory
    clash = [
        f"{key}={format_spec(value) if isinstance(value, Spec) else value!r}"
        for key, value, ok in (
            ("compressor", inner.compressor, (None,)),
            ("aggregator", inner.aggregator, (None,)),
            ("attack", inner.attack, (None,)),
            ("outer", cfg.outer.strategy, (None,)),
            ("elastic", cfg.elastic.enabled, (False,)),
            ("resume", c.resume, ("",)),
            ("checkpoint.every", c.every, (0,)),
            ("checkpoint.memory_every", c.memory_every, (0,)),
            ("checkpoint.remote_every", c.remote_every, (0,)),
            ("checkpoint.policy", c.policy, (None,)),
            ("micro_batch", mem.micro_batch, (0,)),
            ("memory.budget_mb", mem.budget_mb, (0.0,)),
            ("activation_checkpointing", mem.activation_checkpointing, (False,)),
            ("precision", mem.precision, ("fp32", "task")),
        )
        if value not in ok
    ]
    if _communicates(cfg):
        clash.append(f"optimizer={_optimizer_text(cfg)!r}")
    if cfg.world.islands != 1:
        clash.append(f"islands={cfg.world.islands}")
    if clash:
        return (
            f"inner.strategy=pipeline splits one model over the island's ranks and does not yet combine with "
            f"{', '.join(clash)}; drop them, or use inner.strategy=ddp or fsdp for those"
        )
    return None


def _hf_pipeline(cfg: JobConfig, stages: int) -> str | None:
    """A transformers model cut into pipeline pieces (islands.parallel.pipeline.hf_pieces): its layout is known, its
    input and output embeddings are separate parameters, and it has enough pieces. The model is built on the meta
    device: no memory, no weights read."""
    from transformers import AutoModelForCausalLM

    t = cfg.task
    try:
        config = hf.resolve(
            t.model,
            t.model_overrides,
            t.tokenizer,
            t.vocab_size,
            None,
            t.context,
            t.d_model,
            t.n_layers,
            t.n_heads,
            train=False,
        )[2]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except hf.TaskError:
        return None  # the task rule reports it
    name = type(model).__name__
    if not is_causal_lm(model):
        return (
            f"inner.strategy=pipeline: {name} is not a layout islands can cut (GPT-2, or Llama-like: Llama, "
            f"Qwen2, Mistral); use ddp, zero1 or fsdp for it"
        )
    if tied_embeddings(model):
        return (
            f"inner.strategy=pipeline: {name} ties its input and output embeddings, one parameter the first and "
            f"the last stage would both hold; add task.model_overrides='tie_word_embeddings=false'"
        )
    try:
        pieces = len(causal_lm_pieces(model))
    except TypeError as e:
        return f"inner.strategy=pipeline: {e}"
    if stages > pieces:
        return (
            f"inner.stages={stages} but {name} has only {pieces} pieces to cut between (its "
            f"{pieces - 2} layers, the embedding and the head); use stages <= {pieces}"
        )
    return None


def checkpointing(cfg: JobConfig) -> str | None:
    """The checkpoint settings as objects (their own checks), and that a resume checkpoint fits this model."""
    checkpoint_settings(cfg)
    if cfg.checkpoint.resume:
        check_resume(cfg.checkpoint.resume, fingerprint(cfg))
    return None


def _outer_name(spec) -> str | None:
    """The outer strategy's name, or None where the spec is bad (its own check reports that)."""
    try:
        return parse_outer(spec).name
    except ValueError:
        return None


def simulated(cfg: JobConfig) -> str | None:
    """world.simulate: the islands are threads of one process (islands.simulate), one worker each, no network."""
    w, c = cfg.world, cfg.checkpoint
    if not w.simulate:
        return None
    if w.workers != w.islands:
        return (
            f"world.simulate runs one worker per island: set workers={w.islands} (= islands) or islands="
            f"{w.workers}; got workers={w.workers}, islands={w.islands}"
        )
    clash = [
        f"{key}={value!r}"
        for key, value, off in (
            ("elastic", cfg.elastic.enabled, False),
            ("testbed", w.testbed, ""),
            ("checkpoint.every", c.every, 0),
            ("checkpoint.memory_every", c.memory_every, 0),
            ("checkpoint.remote_every", c.remote_every, 0),
            ("checkpoint.policy", c.policy, None),
            ("resume", c.resume, ""),
        )
        if value != off
    ]
    if cfg.inner_strategy not in ("auto", "single", "ddp"):
        clash.append(f"inner.strategy={cfg.inner_strategy}")
    if cfg.outer.strategy is not None and _outer_name(cfg.outer.strategy) == "ps":
        # each simulated island builds its own strategy; ps islands must share one server (InProcessServer)
        clash.append("outer=ps (from Python: every island's ParameterServer given one host=InProcessServer())")
    if _communicates(cfg):
        clash.append(f"optimizer={_optimizer_text(cfg)!r}")
    if clash:
        return (
            f"world.simulate does not yet combine with {', '.join(clash)}: the simulation has no network, no "
            f"process group for checkpoints or an inner strategy; drop them, or run real processes"
        )
    return None


def elastic(cfg: JobConfig) -> str | None:
    """Elastic mode: an outer strategy; islands of one worker, or of k with ddp, zero1 or fsdp inside
    (docs/membership.md; fsdp takes what the sharding rule lets through: plain diloco rounds, per shard)."""
    restarts = cfg.elastic.max_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        return f"elastic.max_restarts must be an integer >= 0; got {restarts!r}"
    if cfg.elastic.store and not cfg.elastic.enabled:
        return "elastic.store (--store) applies to elastic jobs; add elastic.enabled (--elastic) or leave it out"
    if not cfg.elastic.enabled:
        return (
            (
                "elastic.max_restarts applies to elastic jobs (a failed island is started again); add "
                "elastic.enabled (--elastic) or leave it 0"
            )
            if restarts
            else None
        )
    if cfg.outer.strategy is None:
        return (
            "elastic needs an outer strategy (e.g. outer.strategy='diloco:inner_steps=20'): members meet only "
            "at its synchronisations"
        )
    k = cfg.workers_per_island
    if cfg.inner.strategy == "pipeline":
        return (
            "elastic islands of several workers take inner.strategy ddp, zero1 or fsdp; inner.strategy=pipeline "
            "is refused: a pipeline splits the model into stages, so no one worker holds the island's global "
            "model, and its stage schedule has no per-shard outer exchange"
        )
    if k > 1:
        given = [f"inner.{key}" for key in ("compressor", "aggregator", "attack") if getattr(cfg.inner, key)]
        if given:
            return (
                f"elastic islands of several workers run plain ddp, zero1 or fsdp inside; {', '.join(given)} "
                "is not supported there yet (robust aggregation and attacks plan by global rank, which changes "
                "with membership); leave it out"
            )
    outer = make_outer(cfg.outer.strategy, warmup=cfg.train.warmup)
    refusal = outer.elastic_refusal()  # the strategy's own rule
    if refusal:
        return f"outer.strategy: {refusal}"
    if isinstance(outer, ServedParticipant) and (
        cfg.checkpoint.every or cfg.checkpoint.policy or cfg.checkpoint.memory_every or cfg.checkpoint.remote_every
    ):
        return (
            f"checkpoint: an elastic {outer.name} job keeps its state in the server processes' journals; its own "
            "checkpoints are not supported yet (islands are not in step, and a joiner holds no epoch rank until "
            "the end): leave checkpoint.every at 0"
        )
    if _communicates(cfg):
        return (
            f"train.optimizer={_optimizer_text(cfg)!r} communicates inside an island; elastic mode has one worker "
            "per island, use optimizer='adamw'"
        )
    try:
        CheckpointDriver.check_elastic(checkpoint_settings(cfg))  # the driver's own rule
    except ValueError as e:
        return f"checkpoint: {e}"
    if cfg.elastic.heartbeat_timeout <= 0:
        return f"elastic.heartbeat_timeout must be > 0 seconds; got {cfg.elastic.heartbeat_timeout}"
    if cfg.elastic.store:
        try:
            address = EtcdAddress.parse(cfg.elastic.store)
            if address.tls:
                EtcdTLS.from_env()
            EtcdLogin.from_env()  # every process reads the same environment: a bad setting is named here, once
        except ValueError as e:
            return f"elastic.store: {e}"
    return None


def loggers(cfg: JobConfig) -> str | None:
    """output.log names known loggers whose packages are installed (each worker would fail on a missing one)."""
    try:
        names = parse_logger_names(cfg.output.log)
    except ValueError as e:
        return f"output.log: {e}"
    missing = missing_packages(names)
    if missing:
        return (
            f"output.log={cfg.output.log!r}: not installed: {', '.join(missing)}; pip install 'islands[loggers]' "
            "or drop them from output.log"
        )
    return None


def user_task(cfg: JobConfig) -> str | None:
    """A user's task builds, has something to train, and its model takes its first batch to a scalar loss: tried
    once here, on the CPU and outside the training RNG, so a mistake is a message before any worker starts."""
    if not is_user_task(cfg.task.name):
        return None
    with torch.random.fork_rng():
        task = build_task(cfg)
        if not any(p.requires_grad for p in task.model.parameters()):
            return (
                f"task {cfg.task.name!r}: the model ({type(task.model).__name__}) has no trainable parameters; "
                "nothing to train"
            )
        batch = batch_source(task.train_data, 0, cfg.world.workers, task.batch_size, cfg.train.seed).next()
        with torch.no_grad():
            compute_loss(task.model, batch, task.loss_fn, explain=True)
    return None


def hf_task(cfg: JobConfig) -> str | None:
    """hf-causal-lm: the model, its overrides, the tokenizer and the corpus resolve (islands.tasks.hf_lm.check:
    no BPE trained, no weights read), before any worker starts or any run directory is written."""
    t = cfg.task
    if t.name != hf.NAME:
        given = [
            k
            for k in ("model", "model_overrides", "tokenizer", "vocab_size", "text_column")
            if getattr(t, k) != getattr(type(t)(), k)
        ]
        verb = "applies" if len(given) == 1 else "apply"
        return f"task.{', task.'.join(given)} {verb} to task {hf.NAME} only" if given else None
    return hf.check(
        t.model,
        t.model_overrides,
        t.tokenizer,
        t.vocab_size,
        t.data,
        t.context,
        t.d_model,
        t.n_layers,
        t.n_heads,
        cfg.checkpoint.resume,
        t.text_column,
    )


def payload_auth(cfg: JobConfig) -> str | None:
    """outer.authenticate: islands (static or elastic) that exchange through an outer strategy, as processes."""
    if not cfg.outer.authenticate:
        return None
    if cfg.outer.strategy is None or cfg.world.islands < 2:
        return (
            "outer.authenticate signs what islands send each other; it needs world.islands >= 2 and an outer "
            "strategy (e.g. outer.strategy='diloco:inner_steps=100')"
        )
    if cfg.world.simulate:
        return "outer.authenticate applies to islands as processes; simulated islands exchange inside one process"
    return None


Rule = Callable[[JobConfig], "str | list[str] | None"]
# A rule that combines sections reads values the single-section rules check first: it runs only when those passed
# (a rule that divides by world.workers needs workers >= 1; one that builds the task needs its shapes and data).
VALUES = ("choices", "positive", "shapes", "specs")
TASK = VALUES + ("data",)
CLEAN = ("*",)  # builds the task or model: runs only when no rule before it found a problem
RULES: list[tuple[str, Rule, tuple[str, ...]]] = [
    ("choices", choices, ()),
    ("positive", positive, ()),
    ("device has GPUs", device_has_gpus, ("choices", "positive")),
    ("cross backend", cross_backend, ("choices",)),
    ("elastic on GPUs", elastic_on_gpus, VALUES),
    ("shapes", shapes, ("positive",)),
    ("data", data, ("choices",)),
    ("testbed", testbed, ()),
    ("specs", specs, ()),
    ("slowdown", slowdown, VALUES),
    ("adaptive rounds", adaptive_rounds, VALUES),
    ("optimizer and exchange", optimizer_exchange, VALUES),
    ("islands need an outer strategy", islands_need_outer, VALUES),
    ("sharding", sharding, VALUES),
    ("memory", memory, TASK),
    ("pipeline", pipeline, TASK),
    ("compile", compiled, ("choices",)),
    ("checkpointing", checkpointing, CLEAN),
    ("simulated islands", simulated, VALUES),
    ("elastic", elastic, VALUES),
    ("authenticated payloads", payload_auth, ()),
    ("loggers", loggers, ()),
    ("user task", user_task, CLEAN),
    ("hf-causal-lm task", hf_task, ("choices", "positive", "data")),
]


def problems(cfg: JobConfig) -> list[str]:
    """Every problem the rules find, in rule order, each once. A rule whose inputs another rule refused is skipped
    (its verdict would restate that problem); a component's ValueError is that rule's problem."""
    found: list[str] = []
    failed: set[str] = set()
    for name, rule, needs in RULES:
        if failed.intersection(needs) or (found and "*" in needs):
            continue
        try:
            result = rule(cfg)
        except ValueError as e:  # a component's parser or settings refused a value: its message says why
            result = str(e)
        except Exception:
            if found:  # a rule tripping over a value already reported: that report says it
                continue
            raise
        new = [m for m in ([result] if isinstance(result, str) else result or ()) if m and m not in found]
        if new:
            failed.add(name)
            found.extend(new)
    return found


def report(found: list[str]) -> str:
    """One problem: its message. Several: a count, then each problem from its own line ('- '), its continuation
    lines (a registry's list of valid specs) indented under it."""
    if len(found) == 1:
        return found[0]
    return f"{len(found)} problems in the config:\n" + "\n".join("- " + m.replace("\n", "\n  ") for m in found)


def validate(cfg: JobConfig) -> JobConfig:
    """The config, or a ConfigError listing every problem the rules find (the CLI prints it and exits 2)."""
    found = problems(cfg)
    if found:
        raise ConfigError(report(found))
    return cfg
