"""Where the time goes in one churn run of the parameter-server experiment (issue #36, setting (c)): per island
incarnation its steps and pushes (ps) or exchanges (DiLoCo), each kill's cost from SIGKILL to the restarted
island's first push (launcher restart, process up, model pulled or admitted, first step, first push), the
staleness of every push (other islands' pushes applied between its pull and its push: quorum 1 makes one version
per push) and rank 0's evaluated loss around each kill. Reads a run directory that scripts/ps_churn_quick.py wrote
(RUN_DIR/live/*.jsonl every step, RUN_DIR/elastic/*.json, and the kills it logged in churn.json):

    PYTHONPATH=src:bench python scripts/ps_churn_timeline.py OUT_DIR            # every run under OUT_DIR/runs
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def incarnations(run_dir: Path) -> dict[str, list[dict]]:
    """name -> its live log's metric lines with a step, in order."""
    out = {}
    for path in sorted((run_dir / "live").glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[path.stem] = [e for e in lines if e.get("kind") == "metrics" and isinstance(e.get("step"), int)]
    return out


def pushes(lines: list[dict]) -> list[tuple[float, int]]:
    """(wall time, step) of each round's end: where the bytes sent for pushes (ps) or outer exchanges (DiLoCo) grow
    by a model's worth (a PULL or a DONE poll sends a few bytes on the same counter)."""
    sent = [
        (e["t"], e["step"], sum(v for k, v in e["metrics"].items() if k in ("comm/sent_bytes/ps_push", SENT_DILOCO)))
        for e in lines
    ]
    grow = [(t, step, b - a) for (_, _, a), (t, step, b) in zip([(0, 0, 0.0)] + sent[:-1], sent)]
    big = max((g for _, _, g in grow), default=0.0)
    return [(t, step) for t, step, g in grow if g > 0 and g >= big / 2]


SENT_DILOCO = "comm/sent_bytes/outer_delta"


def timeline(run_dir: Path, kills: list[dict]) -> dict:
    logs = {name: lines for name, lines in incarnations(run_dir).items() if lines}  # killed before a step: none
    t0 = min(e["t"] for lines in logs.values() for e in lines[:1])
    rounds = {name: pushes(lines) for name, lines in logs.items()}
    every = sorted((t, name) for name, ps in rounds.items() for t, _ in ps)
    # staleness of a push: other incarnations' pushes between this one's previous push (its pull) and this one
    stale: dict[str, list[int]] = {}
    for name, ps in rounds.items():
        pulled = [logs[name][0]["t"]] + [t for t, _ in ps[:-1]]
        stale[name] = [sum(1 for u, other in every if other != name and a < u < t) for a, (t, _) in zip(pulled, ps)]
    path = run_dir / "elastic" / "restarts.json"
    restarts = json.loads(path.read_text())["restarts"] if path.is_file() else []
    names = sorted(logs)
    val = [(e["t"] - t0, e["step"], e["metrics"]["val/loss"]) for e in logs.get("w0", []) if "val/loss" in e["metrics"]]
    costs = []
    for i, kill in enumerate(kills):
        nxt = restarts[i]["workers"][0] if i < len(restarts) else None
        row = {"kill": round(kill["time"] - t0, 2), "round": kill["round"], "killed": kill["name"]}
        if nxt is not None and logs.get(nxt):
            first = logs[nxt][0]
            row.update(
                restarted=round(restarts[i]["time"] - kill["time"], 2),
                first_step=round(first["t"] - kill["time"], 2),
                at_step=first["step"],
                first_push=round(rounds[nxt][0][0] - kill["time"], 2) if rounds[nxt] else None,
            )
            killed = logs.get(kill["name"], [])
            row["killed_last_step"] = killed[-1]["step"] if killed else None
            before = [v for v in val if v[0] <= kill["time"] - t0]
            after = [v for v in val if v[0] > kill["time"] - t0][:3]
            row["val_before"] = [round(v[2], 3) for v in before[-1:]]
            row["val_after"] = [round(v[2], 3) for v in after]
        costs.append(row)
    return {
        "incarnations": {
            n: {
                "steps": [logs[n][0]["step"], logs[n][-1]["step"]],
                "wall": [round(logs[n][0]["t"] - t0, 2), round(logs[n][-1]["t"] - t0, 2)],
                "rounds": len(rounds[n]),
                "staleness": stale[n],
            }
            for n in names
            if logs[n]
        },
        "kills": costs,
        "val": [(round(t, 2), s, round(v, 4)) for t, s, v in val],
        "mean_staleness": statistics.mean([s for v in stale.values() for s in v] or [0]),
    }


def main(out: Path) -> None:
    result = json.loads((out / "churn.json").read_text())
    report = {}
    for row in result["rows"]:
        run_dir = Path(row["run_dir"])
        report[run_dir.name] = tl = timeline(run_dir, row.get("kill_log", []))
        print(f"== {run_dir.name}: time to target {row['time_to_target_s']}, mean staleness {tl['mean_staleness']:.2f}")
        for name, inc in tl["incarnations"].items():
            print(f"  {name}: steps {inc['steps']} wall {inc['wall']} rounds {inc['rounds']} stale {inc['staleness']}")
        for k in tl["kills"]:
            print("  kill", k)
    (out / "timeline.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
