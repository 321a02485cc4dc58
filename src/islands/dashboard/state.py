"""A run directory read into the one JSON-able state the dashboard page draws.

What it reads (nothing else in the run directory is looked at):

    RUN_DIR/live/<stream>.jsonl   every process's live stream (islands.observe.JsonLines): params, metrics, events
    RUN_DIR/run.json              rank 0's run record, written at the end (its numbers win once it is there)
    RUN_DIR/elastic/<name>.json   an elastic worker's membership record (islands.app.elastic_worker)

A run of an older version has run.json and no live/: its series come from run.json alone.

`RunReader` keeps what it has parsed and reads only the bytes appended since its last poll, so the page can
ask every two seconds while a long run goes. A line still being written is left for the next poll, as
islands.observe.read_lines does.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from datetime import datetime
from pathlib import Path

LIVE_DIR = "live"
STALLED_AFTER_S = 600.0  # no new line for this long and no run.json: the run has probably stopped
MAX_POINTS = 2000  # per series sent to the page; longer series are thinned (the last point is kept)


# ---- one live stream, read incrementally ------------------------------------------------------------
class Stream:
    """One `live/<name>.jsonl`, folded into series as its lines arrive."""

    ident: tuple[int, int] | None  # (device, inode) of the file read so far
    first_t: float | None
    last_t: float | None
    params_t: float | None
    step: int | None

    def __init__(self, path: Path):
        self.path, self.name = path, path.stem
        self._reset()

    def _reset(self) -> None:
        self.offset, self.ident, self.head = 0, None, b""
        self.params: dict = {}
        self.first_t = self.last_t = self.params_t = None
        self.step = None
        self.series: dict[str, tuple[list, list]] = {}  # metric name -> (steps, values)
        self.latest: dict[str, float] = {}
        self.events: list[dict] = []

    def poll(self) -> bool:
        """Parse what was appended since the last poll; True when something new arrived."""
        try:
            st = self.path.stat()
        except OSError:
            return False
        ident = (st.st_dev, st.st_ino)
        with open(self.path, "rb") as f:
            # A new file under the same name: another inode, a shorter file, or (rewritten in place to
            # the same length or longer) a different first line. Start over.
            if ident != self.ident or st.st_size < self.offset or (self.head and f.read(len(self.head)) != self.head):
                self._reset()
                self.ident = ident
            if st.st_size == self.offset:
                return False
            f.seek(self.offset)
            chunk = f.read(st.st_size - self.offset)
        end = chunk.rfind(b"\n")
        if end < 0:  # only a line still being written
            return False
        if self.offset == 0:
            self.head = chunk[: min(end + 1, 256)]
        for raw in chunk[:end].split(b"\n"):
            try:
                line = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(line, dict):
                self._fold(line)
        self.offset += end + 1
        return True

    def _fold(self, line: dict) -> None:
        t = line.get("t")
        if isinstance(t, (int, float)):
            self.first_t = t if self.first_t is None else min(self.first_t, t)
            self.last_t = t if self.last_t is None else max(self.last_t, t)
        kind = line.get("kind")
        if kind == "params" and isinstance(line.get("params"), dict):
            self.params.update(line["params"])
            self.params_t = t
        elif kind == "metrics" and isinstance(line.get("metrics"), dict):
            step = _int(line.get("step"))
            if step is None:
                return
            self.step = step if self.step is None else max(self.step, step)
            for name, value in line["metrics"].items():
                value = _num(value)
                if value is None:
                    continue
                steps, values = self.series.setdefault(name, ([], []))
                # a resumed run appends from its resume step: what it logs again replaces the earlier entries
                while steps and steps[-1] >= step:
                    steps.pop()
                    values.pop()
                steps.append(step)
                values.append(value)
                self.latest[name] = value
        elif kind == "event" and isinstance(line.get("event"), dict):
            self.events.append({"t": t, "step": _int(line.get("step")), **line["event"]})

    # ---- views ----------------------------------------------------------------------------------
    @property
    def rank(self) -> int | None:
        return _int(self.params.get("world.rank"))

    @property
    def island(self) -> int | None:
        return _int(self.params.get("world.island"))

    def get(self, name: str) -> tuple[list, list]:
        return self.series.get(name, ([], []))

    def val_points(self) -> dict:
        """Validation loss against step and against the MB this rank had sent at that evaluation."""
        steps, losses = self.get("val/loss")
        sent = dict(zip(*self.get("val/sent_mb")))
        return {"step": list(steps), "loss": list(losses), "sent_mb": [sent.get(s) for s in steps]}


# ---- the reader ------------------------------------------------------------------------------------
class RunReader:
    """What the dashboard knows about one run directory; `state()` re-reads only what changed."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._streams: dict[Path, Stream] = {}
        self._files: dict[Path, tuple] = {}  # run.json, elastic/*.json: path -> (stat key, parsed)
        self._lock = threading.Lock()

    def _json_file(self, path: Path):
        try:
            st = path.stat()
        except OSError:
            self._files.pop(path, None)
            return None
        key = (st.st_mtime_ns, st.st_size)
        cached = self._files.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None if cached is None else cached[1]  # mid-replace: keep the last good read
        self._files[path] = (key, value)
        return value

    def _poll(self) -> tuple[list[Stream], dict | None, list[dict], str]:
        live = self.run_dir / LIVE_DIR
        paths = sorted(live.glob("*.jsonl")) if live.is_dir() else []
        for path in paths:
            if path not in self._streams:
                self._streams[path] = Stream(path)
            self._streams[path].poll()
        streams = [self._streams[p] for p in paths]
        streams.sort(key=lambda s: (s.rank is None, s.rank if s.rank is not None else 0, s.name))
        record = self._json_file(self.run_dir / "run.json")
        record = record if isinstance(record, dict) else None
        elastic_dir = self.run_dir / "elastic"
        members = [
            m
            for p in (sorted(elastic_dir.glob("*.json")) if elastic_dir.is_dir() else [])
            if isinstance(m := self._json_file(p), dict)
        ]
        seen = ([(s.name, s.offset) for s in streams], sorted((str(p), k[0]) for p, (k, _) in self._files.items()))
        rev = hashlib.sha1(repr(seen).encode()).hexdigest()[:16]  # the page redraws its charts when this changes
        return streams, record, members, rev

    def state(self, now: float | None = None) -> dict:
        with self._lock:
            streams, record, members, rev = self._poll()
            return clean(build(self.run_dir, streams, record, members, rev, time.time() if now is None else now))


def build_state(run_dir: str | Path) -> dict:
    """The state of `run_dir` as the page gets it from /api/state (one full read)."""
    return RunReader(run_dir).state()


# ---- the state -------------------------------------------------------------------------------------
def build(run_dir: Path, streams: list[Stream], record: dict | None, members: list[dict], rev: str, now: float) -> dict:
    summary = (record or {}).get("summary") or {}
    first = streams[0] if streams else None
    params = first.params if first else {}
    last_t = max((s.last_t for s in streams if s.last_t is not None), default=None)
    started = _parse_time((record or {}).get("started"))
    t0 = min([s.first_t for s in streams if s.first_t is not None] + ([started] if started else []), default=None)
    began = max((s.params_t for s in streams if s.params_t is not None), default=None)
    status, status_text = _status(record, began, last_t, now, run_dir)
    config = (record or {}).get("config") or {}
    steps_total = _int(params.get("config.train.steps")) or _int((config.get("train") or {}).get("steps"))
    step = max((s.step for s in streams if s.step is not None), default=None)
    if status == "finished" and _int(summary.get("steps")) is not None:
        step = _int(summary["steps"])
    return {
        "version": 1,
        "run_dir": str(run_dir),
        "status": status,
        "status_text": status_text,
        "now": now,
        "t0": t0,
        "last_update": last_t,
        "rev": rev,
        "source": "live" if streams else ("run.json" if record else "none"),
        "job": _job(params, record, summary, steps_total),
        "step": step,
        "numbers": _numbers(streams, summary, status),
        "val": _val(streams, record),
        "ranks": [_rank(s) for s in streams] if streams else _ranks_from_record(record),
        "link_reference": _link_reference(params, record),
        "membership": _membership(streams, record, members, t0),
        "checkpoint": _checkpoint(streams, record, params),
    }


def _status(record, began, last_t, now, run_dir: Path) -> tuple[str, str]:
    if record is not None:  # rank 0 writes run.json at the end
        # a run resumed into the same directory starts its streams again after the old run.json: running
        record_t = _parse_time(record.get("finished"))
        if not (began and record_t and began > record_t + 1.0):
            return "finished", f"finished {record.get('finished') or ''}".strip()
    if last_t is None:
        if not run_dir.exists():
            return "waiting", f"{run_dir} does not exist yet"
        return "waiting", "no live stream and no run.json yet"
    idle = max(now - last_t, 0.0)
    if idle > STALLED_AFTER_S:
        return "stalled", f"no new line for {_duration(idle)} and no run.json: the run may have stopped"
    return "running", f"running, last line {_duration(idle)} ago"


def _job(params: dict, record, summary: dict, steps_total) -> dict:
    record = record or {}
    return {
        "task": summary.get("task") or params.get("task"),
        "strategy": summary.get("strategy") or params.get("strategy"),
        "workers": _int(summary.get("workers")) or _int(params.get("world.size")),
        "islands": _int(summary.get("islands")) or _int(params.get("world.islands")),
        "steps_total": steps_total,
        "interconnect": record.get("interconnect_line") or params.get("interconnect"),
        "baseline": (record.get("baseline") or {}).get("definition")
        or summary.get("baseline")
        or params.get("baseline"),
    }


def _numbers(streams: list[Stream], summary: dict, status: str) -> dict:
    """The key numbers: run.json's summary once the run finished (equal to what it reports), else the
    latest live values."""
    out: dict = {
        "val_loss": None,
        "val_step": None,
        "val_accuracy": None,
        "train_loss": None,
        "mb_sent_per_worker": None,
        "utilisation": None,
        "utilisation_of": None,
        "tokens_per_s": None,
        "wall_s": None,
        "from": "live",
    }
    with_val = [s for s in streams if s.get("val/loss")[0]]
    if with_val:
        steps, losses = with_val[0].get("val/loss")
        out["val_loss"], out["val_step"] = losses[-1], steps[-1]
        acc = with_val[0].get("val/accuracy")
        out["val_accuracy"] = acc[1][-1] if acc[1] else None
    with_train = [s for s in streams if s.get("train/loss")[0]]
    if with_train:
        out["train_loss"] = with_train[0].get("train/loss")[1][-1]
    sent = [s.latest["comm/sent_mb"] for s in streams if "comm/sent_mb" in s.latest]
    if sent:
        out["mb_sent_per_worker"] = sum(sent) / len(sent)
    util = [s.latest["time/utilisation"] for s in streams if "time/utilisation" in s.latest]
    if util:
        out["utilisation"] = sum(util) / len(util)
        out["utilisation_of"] = f"mean of {len(util)} rank(s)" if len(util) > 1 else "rank 0"
    if streams and "train/tokens_per_s" in streams[0].latest:
        out["tokens_per_s"] = streams[0].latest["train/tokens_per_s"]
    if streams and "time/elapsed_s" in streams[0].latest:
        out["wall_s"] = streams[0].latest["time/elapsed_s"]
    if summary and status == "finished":
        out["from"] = "run.json"
        for key, name in (
            ("val_loss", "final_val_loss"),
            ("val_accuracy", "final_val_accuracy"),
            ("train_loss", "final_train_loss"),
            ("mb_sent_per_worker", "mb_sent_per_worker"),
            ("tokens_per_s", "tokens_per_second"),
            ("wall_s", "wall_seconds"),
        ):
            if _num(summary.get(name)) is not None:
                out[key] = _num(summary[name])
        if out["val_loss"] is not None and summary.get("steps") is not None:
            out["val_step"] = _int(summary["steps"])
        if out["utilisation"] is None and _num(summary.get("wall_seconds")):
            blocked = _num(summary.get("sync_blocked_seconds")) or 0.0
            out["utilisation"] = 1.0 - blocked / summary["wall_seconds"]
            out["utilisation_of"] = "rank 0"
    return out


def _val(streams: list[Stream], record) -> dict:
    """Validation loss (the global model's) against steps and MB sent: run.json's series once it is there,
    else the lowest rank's live stream that evaluates."""
    series = ((record or {}).get("series") or {}).get("val") or []
    if series:
        rows = [v for v in series if _num(v.get("val_loss")) is not None]
        return {
            "step": [v["step"] for v in rows],
            "loss": [v["val_loss"] for v in rows],
            "sent_mb": [v.get("mb_sent") for v in rows],
            "source": "run.json",
        }
    for s in streams:
        points = s.val_points()
        if points["step"]:
            return {**points, "source": s.name}
    return {"step": [], "loss": [], "sent_mb": [], "source": None}


def _rank(s: Stream) -> dict:
    def pair(name: str) -> dict:
        steps, values = _thin(*s.get(name))
        return {"step": steps, "value": values}

    return {
        "name": s.name,
        "rank": s.rank,
        "island": s.island,
        "first_t": s.first_t,
        "last_t": s.last_t,
        "step": s.step,
        "train_loss": pair("train/loss"),
        "utilisation": pair("time/utilisation"),
        "link_gbit_s": pair("link/achieved_gbit_s"),
        "sent_mb": pair("comm/sent_mb"),
        "latest": {
            k: s.latest.get(m)
            for k, m in (
                ("utilisation", "time/utilisation"),
                ("link_gbit_s", "link/achieved_gbit_s"),
                ("sent_mb", "comm/sent_mb"),
                ("tokens_per_s", "train/tokens_per_s"),
                ("train_loss", "train/loss"),
                ("blocked_s", "time/blocked_s"),
                ("elapsed_s", "time/elapsed_s"),
            )
        },
    }


def _ranks_from_record(record) -> list[dict]:
    """An old run (no live/): each rank's totals from run.json; the train series is rank 0's."""
    if not record:
        return []
    per_rank = (record.get("comm") or {}).get("per_rank") or []
    world = record.get("world") or {}
    per_island = _int(world.get("workers_per_island")) or 1
    train = (record.get("series") or {}).get("train") or []
    final_step = _int((record.get("summary") or {}).get("steps"))
    out = []
    for r, led in enumerate(per_rank):
        busy, total = _num(led.get("busy_seconds")), _num(led.get("total_sent"))
        link = total * 8 / busy / 1e9 if busy and total is not None else None
        empty: dict[str, list] = {"step": [], "value": []}
        out.append(
            {
                "name": f"rank{r}",
                "rank": r,
                "island": r // per_island,
                "first_t": None,
                "last_t": None,
                "step": final_step,
                "train_loss": (
                    {"step": [e["step"] for e in train], "value": [e["loss"] for e in train]} if r == 0 else empty
                ),
                "utilisation": empty,
                "link_gbit_s": {"step": [final_step], "value": [link]} if link is not None else empty,
                "sent_mb": {"step": [final_step], "value": [total / 1e6]} if total is not None else empty,
                "latest": {
                    "utilisation": None,
                    "link_gbit_s": link,
                    "sent_mb": None if total is None else total / 1e6,
                    "tokens_per_s": None,
                    "train_loss": None,
                    "blocked_s": None,
                    "elapsed_s": None,
                },
            }
        )
    return out


def _link_reference(params: dict, record) -> dict:
    """The interconnect probe's rates, the ceiling the achieved rates are read against (Gbit/s)."""
    inter = (record or {}).get("interconnect") or {}
    p2p = _num((inter.get("p2p") or {}).get("bandwidth_gbit_s")) or _num(
        params.get("interconnect.p2p.bandwidth_gbit_s")
    )
    busbw = None
    rows = inter.get("all_reduce")
    if not isinstance(rows, list) and isinstance(params.get("interconnect.all_reduce"), str):
        try:
            rows = json.loads(params["interconnect.all_reduce"])
        except ValueError:
            rows = None
    if isinstance(rows, list) and rows and isinstance(rows[-1], dict) and _num(rows[-1].get("busbw_gb_s")) is not None:
        busbw = rows[-1]["busbw_gb_s"] * 8  # GB/s -> Gbit/s, at the largest size probed
    return {"p2p_gbit_s": p2p, "all_reduce_busbw_gbit_s": busbw}


# ---- membership ------------------------------------------------------------------------------------
def _membership(streams: list[Stream], record, members: list[dict], t0) -> dict:
    """One row per process (grouped by island): the time it was seen active, and the membership events.
    Times are seconds since the run's first line (t0)."""
    rows: list[dict] = []
    events: list[dict] = []

    def rel(t):
        return None if t is None or t0 is None else t - t0

    for s in streams:
        island = s.island
        rows.append(
            {
                "label": f"island {island if island is not None else '?'} · {s.name}",
                "island": island,
                "name": s.name,
                "start": rel(s.first_t),
                "end": rel(s.last_t),
                "source": "live",
            }
        )
    live_names = {s.name for s in streams}
    spans = {}  # an elastic member without a live stream: active from its first to its last synchronisation
    for m in members:
        syncs = [x for x in m.get("syncs") or [] if isinstance(x, dict) and _num(x.get("start")) is not None]
        if str(m.get("name", "?")) not in live_names and syncs:
            spans[str(m.get("name", "?"))] = (
                min(x["start"] for x in syncs),
                max(x["start"] + (_num(x.get("seconds")) or 0.0) for x in syncs),
            )
    if t0 is None and spans:
        t0 = min(a for a, _ in spans.values())  # an elastic run without live/: time from its first sync
    seen: set = set()
    for s in streams:
        for ev in s.events:
            if ev.get("type") != "membership":
                continue
            change = {k[7:]: v for k, v in ev.items() if k.startswith("change.")}
            _add_event(events, seen, change, s.name, ev.get("t"), ev.get("step"), rel)
    for m in members:
        name = str(m.get("name", "?"))
        if name in spans:
            rows.append(
                {
                    "label": f"member {name}",
                    "island": _int(m.get("slot")),
                    "name": name,
                    "start": rel(spans[name][0]),
                    "end": rel(spans[name][1]),
                    "source": "elastic",
                }
            )
        if not any(s.name == name and any(e.get("type") == "membership" for e in s.events) for s in streams):
            for change in (m.get("final") or {}).get("events") or []:
                if isinstance(change, dict):
                    _add_event(events, seen, change, name, None, change.get("step"), rel)
    if not rows and record:
        world = record.get("world") or {}
        size, per_island = _int(world.get("size")) or 0, _int(world.get("workers_per_island")) or 1
        wall = _num((record.get("summary") or {}).get("wall_seconds"))
        for r in range(size):
            rows.append(
                {
                    "label": f"island {r // per_island} · rank{r}",
                    "island": r // per_island,
                    "name": f"rank{r}",
                    "start": 0.0 if wall is not None else None,
                    "end": wall,
                    "source": "run.json",
                }
            )
    rows.sort(key=lambda r: (r["island"] is None, r["island"] or 0, r["name"]))
    events.sort(key=lambda e: (e["t_s"] is None, e["t_s"] or 0.0))
    return {"t0": t0, "rows": rows, "events": events}


def _add_event(events: list, seen: set, change: dict, stream: str, line_t, step, rel) -> None:
    kind = str(change.get("type", "?"))
    key = (
        kind,
        change.get("epoch"),
        change.get("from_epoch"),
        json.dumps(change.get("gone"), default=str),
        json.dumps(change.get("joined"), default=str),
        change.get("step") if kind == "entered" else None,
        stream if kind in ("entered", "resumed") else None,
    )
    if key in seen:  # every member logs the same failure or join
        return
    seen.add(key)
    t = next((_num(change.get(k)) for k in ("detected", "time", "formed", "resumed") if _num(change.get(k))), None)
    t = t if t is not None else _num(line_t)
    events.append(
        {
            "t_s": rel(t),
            "type": kind,
            "stream": stream,
            "step": _int(change.get("step")) if change.get("step") is not None else step,
            "text": _describe(kind, change),
        }
    )


def _describe(kind: str, c: dict) -> str:
    def names(v):
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                return v
        return ", ".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)

    stall = _num(c.get("stall_seconds"))
    stall_text = f", stalled {stall:.2f} s" if stall is not None else ""
    if kind == "failure":
        return f"failure: {names(c.get('gone'))} gone; epoch {c.get('epoch')} of {c.get('size')}{stall_text}"
    if kind == "join":
        return (
            f"join: {names(c.get('joined'))} at step {c.get('step')}; epoch {c.get('epoch')} of {c.get('size')}"
            f"{stall_text}"
        )
    if kind == "entered":
        return f"entered at step {c.get('step')} (epoch {c.get('epoch')})"
    if kind == "resumed":
        return f"resumed from epoch {c.get('from_epoch')}"
    return kind


# ---- checkpoints -----------------------------------------------------------------------------------
def _checkpoint(streams: list[Stream], record, params: dict) -> dict:
    """Saves per level, the last saved step and the time training stalled for them (rank 0's view)."""
    ck_cfg = ((record or {}).get("config") or {}).get("checkpoint") or {
        k[len("config.checkpoint.") :]: v for k, v in params.items() if k.startswith("config.checkpoint.")
    }
    levels = {
        lv: ck_cfg.get(key)
        for lv, key in (("local", "every"), ("memory", "memory_every"), ("remote", "remote_every"))
        if _int(ck_cfg.get(key))
    }
    if ck_cfg.get("policy") not in (None, "", "null", "None"):
        levels["local"] = "policy"
    out = {
        "configured": bool(levels),
        "levels": levels,
        "saves": {},
        "last_saved_step": None,
        "stall_s": None,
        "resumed_from": None,
        "source": None,
    }
    part = (record or {}).get("checkpoint")
    if isinstance(part, dict) and ("saves" in part or "resumed_from" in part):
        out.update(
            saves=dict(part.get("saves") or {}),
            last_saved_step=part.get("last_saved_step"),
            stall_s=_num(part.get("stall_seconds_total")),
            resumed_from=part.get("resumed_from"),
            source="run.json",
        )
        if isinstance(part.get("levels"), dict):
            out["levels"] = {k: v for k, v in part["levels"].items() if v}
            out["configured"] = True
        return out
    for s in streams:
        saves = {k[len("ckpt/saves/") :]: int(v) for k, v in s.latest.items() if k.startswith("ckpt/saves/")}
        cks = [e for e in s.events if e.get("type") == "checkpoint"]
        if saves or cks:
            out.update(saves=saves, stall_s=s.latest.get("ckpt/stall_s"), source=s.name)
            if cks:
                out["last_saved_step"] = _int(cks[-1].get("last_saved_step"))
                out["stall_s"] = _num(cks[-1].get("stall_s")) if out["stall_s"] is None else out["stall_s"]
            break
    return out


# ---- helpers -----------------------------------------------------------------------------------------
def _num(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def _int(v):
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


def _thin(steps: list, values: list, limit: int = MAX_POINTS) -> tuple[list, list]:
    if len(steps) <= limit:
        return list(steps), list(values)
    stride = math.ceil(len(steps) / limit)
    keep = list(range(0, len(steps) - 1, stride)) + [len(steps) - 1]
    return [steps[i] for i in keep], [values[i] for i in keep]


def _parse_time(text) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def clean(value):
    """JSON-safe: NaN and infinities (run.json may hold them) become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value
