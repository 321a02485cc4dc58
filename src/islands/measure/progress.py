"""What rank 0 shows a person: a live bar while training, a summary table at the end."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class TrainProgress:
    """`enabled`: print at all (rank 0); `bar`: draw the live bar when stdout is a terminal (log lines go above it),
    else the lines alone, as on a pipe or under nohup."""

    def __init__(self, total: int, enabled: bool, start: int = 0, bar: bool = True):
        self.console = Console(stderr=False)
        self.enabled = enabled
        self.live = enabled and bar and self.console.is_terminal
        self.bar = None
        if self.live:
            self.bar = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"),
                TextColumn("{task.fields[tps]:,.0f} tok/s"),
                TextColumn("{task.fields[mb]:.1f} MB sent"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, loss=float("nan"), tps=0.0, mb=0.0)
            self.bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, mb_sent: float) -> None:
        if self.bar is not None:  # set exactly when live
            self.bar.update(self.task, completed=step, loss=loss, tps=tokens_per_s, mb=mb_sent)

    def log(self, text: str) -> None:
        if self.enabled:
            (self.bar.console if self.bar is not None else self.console).print(text)
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def summary_table(summary: dict, interconnect_line: str) -> Table:
    t = Table(title="islands run summary", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    rows = [
        ("strategy", summary["strategy"]),
        ("world", f"{summary['workers']} workers in {summary['islands']} island(s)"),
        ("steps", str(summary["steps"])),
        ("wall time", f"{summary['wall_seconds']:.1f} s"),
        ("tokens/s (all workers)", f"{summary['tokens_per_second']:,.0f}"),
        ("final val loss", _loss(summary.get("final_val_loss"))),
        ("MB sent per worker", _sent(summary)),
        *([("MB sent across islands", _across(summary))] if summary.get("islands", 1) > 1 else []),
        ("time with comm in flight", f"{100 * summary['comm_fraction']:.1f}%"),
        *([("compile time", _compile(summary))] if summary.get("compile_seconds") is not None else []),
        ("interconnect", interconnect_line),
        ("baseline", summary["baseline"]),
    ]
    if summary.get("final_val_accuracy") is not None and summary.get("task") == "digits":
        rows.insert(6, ("final val accuracy", f"{100 * summary['final_val_accuracy']:.1f}%"))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _compile(summary: dict) -> str:
    """torch.compile's cost (a compiled run's row only): the first step over a steady one, and the graphs compiled
    (islands.runtime.compiled); none compiled says the model ran eagerly."""
    graphs = summary.get("compile_graphs")
    if graphs == 0:
        return "nothing compiled: the model ran eagerly (docs/own-model.md, Compiled models)"
    what = f", {graphs} graph(s)" if graphs is not None else ""
    return f"{summary['compile_seconds']:.1f} s (first step over a steady one{what})"


def _loss(value: float | None) -> str:
    return "not evaluated" if value is None else f"{value:.4f}"  # a task without validation data has none


def where_lines(record: dict) -> list[str]:
    """Where a run's files went, one line each: run.json and the plot, the model (its `model` entry, written by
    islands.loop.callbacks.SaveModel), the launcher's logs when there are."""
    if not record.get("run_dir"):
        return []
    run_dir = Path(record["run_dir"])
    lines = [f"run record: {run_dir / 'run.json'}  plot: {run_dir / 'loss.png'}"]
    model = record.get("model")
    if model:
        lines.append(f"model: {model['dir']} (step {model['step']}, {model['format']})")
    if (run_dir / "logs").is_dir():  # the launcher's: one log per rank
        lines.append(f"logs: {run_dir / 'logs'}")
    return lines


def print_finished(record: dict, console: Console) -> None:
    """The summary table and where the run's files are: the end of every run's output, with or without the bar."""
    console.print(summary_table(record["summary"], record["interconnect_line"]))
    server = server_line(record.get("parameter_server"))
    if server is not None:
        console.print(server, highlight=False, soft_wrap=True)
    for line in where_lines(record):
        console.print(line, highlight=False, soft_wrap=True)  # paths whole, to copy from a log


def server_line(report: dict | None) -> str | None:
    """One line of what a parameter server's servers did (run.json `parameter_server`, islands.sync.outer.ps_report),
    or that their report is incomplete and why; None for a run without one."""
    if not report:
        return None
    servers = report["servers"]
    words = f"parameter server ({report['mode']} mode, {len(servers)} server(s)): "
    if report["cpu_seconds"] is None:
        return words + f"report incomplete: {report['missing']}"
    peak = sum(s["peak_memory_bytes"] for s in servers) / 1e6
    first = servers[0]  # every server counts every push (its own range of it)
    startup = [s["startup_cpu_seconds"] for s in servers if "startup_cpu_seconds" in s]  # server processes
    words += (
        f"{report['cpu_seconds']:.2f} CPU-s"
        + (f" ({sum(startup):.2f} of it start-up)" if startup else "")
        + f", peak {peak:.1f} MB ({first['peak_memory']}), "
        f"{first['pushes_applied']} pushes applied, {first['pushes_refused']} refused, "
        f"{sum(s['duplicates'] for s in servers)} duplicates, {first['windows_stepped']} outer steps, "
        f"goodput {100 * first['goodput']:.1f}%"
    )
    if report["restarts"] is not None:
        words += f", {report['restarts']} restart(s)"
    return words + ("" if report["complete"] else f"; incomplete: {report['missing']}")


def _across(summary: dict) -> str:
    """What crossed the (slow) links between islands, next to plain DDP over every worker, all of which does."""
    mb, ddp = summary.get("cross_island_mb_per_worker", 0.0), summary.get("ddp_mb_per_worker") or 0.0
    return f"{mb:.2f} per worker (plain DDP over all workers: {ddp:.2f}, {ddp / max(mb, 1e-9):.0f}x more)"


def _sent(summary: dict) -> str:
    """MB sent, next to what plain DDP would have sent over the same steps when they differ."""
    mb, ddp = summary["mb_sent_per_worker"], summary.get("ddp_mb_per_worker") or 0.0
    if not ddp or abs(mb - ddp) < 0.01 * ddp:
        return f"{mb:.2f}"
    if mb > ddp:  # DDP inside the islands plus the outer exchanges: the saving is in what crosses islands
        return f"{mb:.2f} (plain DDP: {ddp:.2f})"
    return f"{mb:.2f} (plain DDP: {ddp:.2f}, {ddp / max(mb, 1e-9):.1f}x more)"
