"""The bench harness: a registry of experiments and what every experiment writes.

An experiment is a function `fn(ctx) -> dict` registered with @experiment. It returns:
    rows        list of dicts, the result table (one row per configuration measured)
    headline    list of sentences stating the measured claim, each with its ratio
    plot        optional callable(result, path) drawing plot.png
    extra keys  kept verbatim in result.json
The harness adds what every published number must carry: the interconnect each run measured, the
baseline definition, versions and git revision, the command that reproduces it, and the quick flag.
Ratios are always measured side by side in one invocation, never against stored numbers.

Tiers: full (the published numbers), quick (--quick: a smaller version whose numbers still mean something)
and smoke (--smoke: the quick version shrunk until it only shows the experiment still runs end to end;
its numbers mean nothing). A smoke run has ctx.quick and ctx.smoke set; every training job it starts
is cut to ctx.smoke_steps (SMOKE_STEPS) steps (ctx.config), and an experiment that sizes its own work reads
ctx.smoke, at the top of the experiment: it runs one arm of each kind (a sweep two of its points, not all),
the fewest workers and the smallest model (SMOKE_LM where the size is no code path) that still take every
code path. One whose jobs must outlast something (outer rounds of H steps, a kill at round k, a helper
process's start-up) raises ctx.smoke_steps.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from islands.app.validate import validate
from islands.config import JobConfig, from_mapping
from islands.measure import versions, write_json_atomic
from islands.spec import Spec
from islands_bench.progress import Progress, load_previous


@dataclass
class Experiment:
    name: str
    fn: Callable[[BenchContext], dict]
    practices: tuple[str, ...]
    help: str
    devices: tuple[str, ...] = ("cpu",)  # where its measurement means something (bench --device)


REGISTRY: dict[str, Experiment] = {}
SMOKE_STEPS = 8  # training steps of every job a smoke run starts
SMOKE_LM = dict(d_model=32, n_layers=1, n_heads=2, context=32)  # the byte LM an experiment may shrink to in smoke


def smoke_sized(cfg: JobConfig, steps: int = SMOKE_STEPS) -> JobConfig:
    """cfg cut to a smoke run's length: at most `steps` steps, warm-up, evaluation and logging within them."""
    t = cfg.train
    t.steps = min(t.steps, steps)
    t.warmup = min(t.warmup, t.steps // 2)
    t.eval_every = min(t.eval_every, t.steps)
    t.eval_batches = min(t.eval_batches, 2)
    t.log_every = min(t.log_every, t.steps)
    return cfg


def spec_text(value) -> str:
    """A spec-valued config key as text ("powersgd:rank=4"), from a JobConfig (a Spec) or a run record's
    config (its JSON form); "none" when unset."""
    return "none" if value in (None, "") else str(Spec.from_json(value))


def experiment(name: str, practices: tuple[str, ...] = (), help: str = "", devices: tuple[str, ...] = ("cpu",)):
    def register(fn):
        REGISTRY[name] = Experiment(
            name, fn, tuple(practices), help or (fn.__doc__ or "").strip().split("\n")[0], tuple(devices)
        )
        return fn

    return register


def load_all() -> dict[str, Experiment]:
    import islands_bench.experiments as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")
    return REGISTRY


@dataclass
class BenchContext:
    name: str
    quick: bool
    out_dir: Path
    smoke: bool = False  # --smoke (quick is set too): only that it runs end to end counts (see the module doc)
    smoke_steps: int = SMOKE_STEPS  # a smoke run's jobs' length
    rate: str = ""  # --testbed-rate: run the distributed configurations on a real rate-limited testbed
    device: str = "cpu"  # --device: where the experiment's tensors live (only experiments that declare it)
    reuse: bool = False  # --reuse: a run whose run.json already holds the same config is read, not run again
    console: Console = field(default_factory=Console)
    runs: list[dict] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)  # arms done and left, time left (progress.py)

    def log(self, text: str) -> None:
        self.console.print(f"[dim]{self.name}[/] {text}")

    def plan(self, arms: int) -> None:
        """Declare how many arms (training jobs) this experiment will run, for the progress lines; without
        it the count comes from the previous result of the same experiment."""
        self.progress.plan(arms)

    @contextlib.contextmanager
    def arm(self, label: str):
        """One arm of the experiment: a progress line when it starts and when it ends. train() and
        train_elastic() use it; an experiment that runs its arms another way may wrap them in it."""
        self.log(self.progress.start(label))
        try:
            yield
        except BaseException:
            self.log(self.progress.fail(label))
            raise
        self.log(self.progress.finish(label))

    def config(self, **overrides) -> JobConfig:
        """A validated job config from overrides (flat keys such as workers=2, or dotted ones); a smoke run's
        is cut to SMOKE_STEPS steps."""
        cfg = from_mapping({"progress": False, "output.save_model": False, **overrides})  # arms compare numbers
        return validate(smoke_sized(cfg, self.smoke_steps) if self.smoke else cfg)

    def train(self, label: str, **overrides) -> dict:
        """Run one training job in its own processes; returns its run record (run.json)."""
        import json

        from islands.app.launch import launch

        cfg = self.config(**overrides)
        run_dir = self.out_dir / "runs" / label
        cfg.output.run_dir = str(run_dir)
        done = self._finished(run_dir, cfg) if self.reuse else None
        if done is not None:
            self.log(f"run {label}: reusing {run_dir / 'run.json'} (same config; --reuse)")
            self.log(self.progress.reused(label))
            self.runs.append(done)
            return done
        with self.arm(label):
            self.log(
                f"run {label}: workers={cfg.world.workers} islands={cfg.world.islands} steps={cfg.train.steps} "
                f"inner={cfg.inner_strategy} outer={spec_text(cfg.outer.strategy)} "
                f"compress={spec_text(cfg.inner.compressor)} testbed={cfg.world.testbed or '-'}"
            )
            t = time.perf_counter()
            code = launch(cfg, run_dir)
            if code != 0:
                raise RuntimeError(f"bench run {label!r} failed (exit {code}); logs in {run_dir / 'logs'}")
        record = json.loads((run_dir / "run.json").read_text())
        record["label"] = label
        record["launch_seconds"] = time.perf_counter() - t
        self.runs.append(record)
        return record

    def train_elastic(self, label: str, on_started=None, **overrides) -> dict:
        """Run one elastic job (islands.app.launch.launch_elastic) in a fresh run directory; returns its run
        record. `on_started(address, workers, coordinator)` may inject faults; the job's token is in
        ISLANDS_TOKEN by then. Never reused: a stale elastic/<name>.json would pass for a survivor's."""
        import io
        import json
        import os
        import shutil

        from islands.app.launch import launch_elastic

        run_dir = self.out_dir / "runs" / label
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = self.config(run_dir=str(run_dir), **overrides)
        run_dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("ISLANDS_TOKEN", os.urandom(16).hex())
        with self.arm(label):
            self.log(
                f"run {label}: {cfg.world.workers} elastic workers, outer={spec_text(cfg.outer.strategy)}, "
                f"steps={cfg.train.steps}"
            )
            out = io.StringIO()
            code = launch_elastic(cfg, run_dir, out=out, on_started=on_started)
            if code != 0:  # the logs live in a temporary directory under CI: their tails go into the error
                raise RuntimeError(
                    f"elastic run {label!r} failed (exit {code}); logs in {run_dir / 'logs'}\n"
                    f"{_failed_job_report(out.getvalue(), run_dir / 'logs')}"
                )
        record = json.loads((run_dir / "run.json").read_text())
        record["label"] = label
        self.runs.append(record)
        return record

    @staticmethod
    def _finished(run_dir: Path, cfg: JobConfig) -> dict | None:
        """The run record in run_dir if its config equals cfg in every key but where it ran and whether it
        drew a progress bar, else None. A key the record predates counts as its default (a run made before
        a key existed ran as its default does).

        Lets an interrupted long experiment resume without redoing finished runs, and reads back runs made
        with `islands train` at an experiment's config; a changed config (or a testbed, whose link is
        measured per invocation) always runs again.
        """
        import json

        path = run_dir / "run.json"
        if cfg.world.testbed or not path.is_file():
            return None
        record = json.loads(path.read_text())
        recorded = {k: v for k, v in record.get("config", {}).items() if k != "extra"}  # extra: pre-sections
        try:  # a record from before the sectioned config holds flat keys; from_mapping reads both forms
            have = from_mapping(recorded).to_dict()
        except ValueError:  # a key this islands no longer knows: not the same config
            return None
        want = cfg.to_dict()
        for d in (have, want):
            d["output"] = {}  # where it ran and whether it drew a progress bar are not what it computed
        if have != want:
            return None
        record["label"] = run_dir.name
        record["launch_seconds"] = 0.0
        return record

    @contextlib.contextmanager
    def testbed(self, rate: str, hosts: int):
        """A real rate-limited network for the duration of the block (needs root)."""
        from islands import testbed as tb

        name = f"b{int(time.time()) % 100000}"
        bed = tb.up(name, hosts=hosts, rate=rate)
        try:
            yield bed
        finally:
            tb.down(name)


def _failed_job_report(launcher_out: str, logs: Path, lines: int = 15) -> str:
    """The last lines the launcher printed and of every log under `logs`: why a job failed, readable where its
    run directory is gone (a smoke test's temporary directory)."""
    parts = ["launcher:", *launcher_out.splitlines()[-lines:]]
    for log in sorted(logs.glob("*.log")):
        parts += [f"{log.name}:", *log.read_text(errors="replace").splitlines()[-lines:]]
    return "\n".join(parts)


def _markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)\n"
    keys = list(rows[0].keys())
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _rich_table(title: str, rows: list[dict]) -> Table:
    t = Table(title=title)
    # Long text (the interconnect line) stays in summary.md; the terminal table keeps the numbers.
    keys = [k for k in (rows[0].keys() if rows else []) if not any(len(str(r.get(k, ""))) > 28 for r in rows)]
    for k in keys:
        t.add_column(k)
    for r in rows:
        t.add_row(*[f"{r.get(k):.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys])
    return t


def run(
    name: str,
    quick: bool = False,
    out_root: Path = Path("results"),
    rate: str = "",
    device: str = "cpu",
    reuse: bool = False,
    smoke: bool = False,
) -> Path:
    registry = load_all()
    if name not in registry:
        raise KeyError(f"unknown experiment {name!r}; available: {', '.join(sorted(registry))}")
    exp = registry[name]
    if device not in exp.devices:
        raise KeyError(
            f"experiment {name!r} runs on {', '.join(exp.devices)} only, not --device {device}; "
            f"experiments with a cuda variant: "
            f"{', '.join(sorted(n for n, e in registry.items() if 'cuda' in e.devices))}"
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise KeyError("--device cuda but torch sees no CUDA device on this machine")
    quick = quick or smoke
    tier = "smoke" if smoke else "quick" if quick else "full"
    suffix = (f"-{rate}" if rate else "") + (f"-{device}" if device != "cpu" else "")
    out_dir = out_root / name / (tier + suffix)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = BenchContext(name=name, quick=quick, smoke=smoke, out_dir=out_dir, rate=rate, device=device, reuse=reuse)
    ctx.progress.previous = load_previous(out_dir / "result.json")  # the last invocation's arms: the ETA
    started = time.time()
    result = exp.fn(ctx)
    plot = result.pop("plot", None)
    interconnects = sorted({r.get("interconnect_line", "") for r in ctx.runs} - {""})
    result.setdefault("interconnect", interconnects or ["see rows"])
    result.setdefault("baseline", sorted({r["baseline"]["definition"] for r in ctx.runs}) or ["see rows"])
    command = (
        "islands bench "
        + name
        + (" --smoke" if smoke else " --quick" if quick else "")
        + (f" --testbed-rate {rate}" if rate else "")
        + (f" --device {device}" if device != "cpu" else "")
    )
    record = {
        "experiment": name,
        "practices": list(exp.practices),
        "quick": quick,
        "smoke": smoke,
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": time.time() - started,
        "versions": versions(),
        **result,
        "runs": [
            {"label": r["label"], "summary": r["summary"], "interconnect": r["interconnect"], "config": r["config"]}
            for r in ctx.runs
        ],
        "arm_times": ctx.progress.record(),
    }
    write_json_atomic(out_dir / "result.json", record)
    if plot is not None:
        plot(record, out_dir / "plot.png")
    label = f" ({tier})" if quick else ""
    md = [
        f"# {name}{label}",
        "",
        exp.help,
        "",
        f"Practices: {', '.join(exp.practices) or '-'}  ",
        f"Reproduce: `{command}`  ",
        f"Measured: {record['started']}, git {record['versions']['git_revision']}, torch {record['versions']['torch']}",
        "",
        "## Headline",
        "",
    ]
    md += [f"- {h}" for h in result.get("headline", [])]
    md += ["", "## Interconnect", ""] + [f"- {i}" for i in record["interconnect"]]
    md += ["", "## Baseline", ""] + [f"- {b}" for b in record["baseline"]]
    md += ["", "## Results", "", _markdown_table(result.get("rows", []))]
    if plot is not None:
        md += ["![plot](plot.png)", ""]
    (out_dir / "summary.md").write_text("\n".join(md))
    ctx.console.print(_rich_table(f"{name}{label}", result.get("rows", [])))
    for h in result.get("headline", []):
        ctx.console.print(f"• {h}")
    ctx.console.print(f"written: {out_dir}/result.json, summary.md" + (", plot.png" if plot else ""))
    return out_dir


def print_list() -> None:
    registry = load_all()
    t = Table(title="islands bench experiments")
    t.add_column("name", style="bold")
    t.add_column("practices")
    t.add_column("what it measures")
    for e in sorted(registry.values(), key=lambda e: e.name):
        t.add_row(e.name, ", ".join(e.practices), e.help)
    Console().print(t)
