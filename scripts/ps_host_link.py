"""Where the parameter server sits on a slow link (issue #36, Q-6): item 5's setting (the byte LM, 2 islands of one
worker, global batch 32, H=20, 180 steps) on a 3-host testbed, the islands on hosts 0 and 1, with the server
    ps           a thread of island 0 (the experiment's ps arm: island 0 never waits on the link)
    ps-proc      servers=1, a process on island 0's host (the same place, its own process)
    ps-host      servers=1 on host 2, a host of its own (`islands ps-host`): both islands push over their links
and fp32 DiLoCo on gloo loopback as the reference; each arm's seconds and steps to the target (fp32 DiLoCo's 60-step
loopback loss, item 5's 2.7763 unless --target), its most blocked rank's blocked seconds, and the normalised time
(steps x the reference's compute seconds per step + blocked: parameter_server.normalised_seconds). A one-off
measurement, not a registered benchmark (needs root):

    PYTHONPATH=src:bench python scripts/ps_host_link.py OUT_DIR [--links 20mbit,5mbit]   # writes OUT_DIR/host.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from islands_bench.experiments import parameter_server as ps
from islands_bench.harness import BenchContext

H = 20
PORT = 29650  # inside host 2's own network namespace: nothing else listens there
BASE = dict(task="lm", global_batch=32, workers=2, islands=2, eval_every=H, log_every=H, steps=180, warmup=6)


def arms(host_ip: str) -> list[tuple[str, str]]:
    spec = f"ps:inner_steps={H},max_staleness={ps.STALENESS}"
    return [("ps", spec), ("ps-proc", f"{spec},servers=1"), ("ps-host", f"{spec},servers=1,at='{host_ip}:{PORT}'")]


def start_host(bed) -> subprocess.Popen:
    """`islands ps-host` inside host 2, once it listens."""
    argv = [sys.executable, "-m", "islands", "ps-host", "--port", str(PORT), "--wait", "600"]
    env = dict(os.environ, **bed.env(2), PYTHONUNBUFFERED="1")
    host = subprocess.Popen(bed.wrap(2, argv), env=env, stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    line = host.stdout.readline()
    if "listening on" not in line:
        host.kill()
        raise RuntimeError(f"islands ps-host did not start: {line!r}")
    return host


def row(rec: dict, arm: str, link: str, target: float) -> dict:
    series = rec["series"]["val"]
    steps = ps.steps_to(series, target)
    return {
        "run": arm,
        "link": link,
        "time_to_target_s": ps.time_to(series, target),
        "steps_to_target": steps,
        "blocked_to_target_s": ps.blocked_at(Path(rec["run_dir"]), steps) if steps is not None else None,
        "final_val_loss": rec["summary"]["final_val_loss"],
        "mb_per_worker": ps.mb_per_worker(rec),
        "wire": rec["interconnect"].get("wire_bytes_per_host"),
        "interconnect": rec["interconnect_line"],
        "load": os.getloadavg(),
    }


def main(out: Path, links: tuple[str, ...], target: float, only: tuple[str, ...] = ()) -> None:
    os.environ.setdefault("ISLANDS_TOKEN", os.urandom(16).hex())  # the islands' and the server host's
    ctx = BenchContext(name="parameter-server", quick=True, out_dir=out)
    ref = ctx.train("diloco@loopback", outer=f"diloco:inner_steps={H}", **BASE)
    s = ref["summary"]
    per_step = (s["wall_seconds"] - s["sync_blocked_seconds"]) / s["steps"]
    rows = [row(ref, "diloco", "loopback", target)]
    for link in links:
        with ctx.testbed(link, hosts=3) as bed:
            for arm, spec in arms(bed.host(2).ip):
                if only and arm not in only:
                    continue
                host = start_host(bed) if arm == "ps-host" else None
                try:
                    rec = ctx.train(f"{arm}@{link}", outer=spec, testbed=bed.name, **BASE)
                    if host is not None:
                        host.wait(120)
                finally:
                    if host is not None and host.poll() is None:
                        host.kill()
                rows.append(row(rec, arm, link, target))
    base = rows[0]["time_to_target_s"]
    for r in rows:
        t, n = r["time_to_target_s"], r["steps_to_target"]
        r["normalised_s"] = ps.normalised_seconds(n, per_step, r["blocked_to_target_s"] or 0.0)
        r["vs_diloco_loopback"] = t / base if t and base else None
        r["normalised_vs_diloco_loopback"] = r["normalised_s"] / base if r["normalised_s"] and base else None
    (out / "host.json").write_text(
        json.dumps({"target": target, "per_step": per_step, "rows": rows, "end": time.strftime("%T")}, indent=1)
    )
    for r in rows:
        reach = f"{r['time_to_target_s']:.1f} s at step {r['steps_to_target']}" if r["time_to_target_s"] else "no"
        ratio = r["normalised_vs_diloco_loopback"]
        print(
            f"{r['run']}@{r['link']}: {reach}; blocked {r['blocked_to_target_s']}; normalised "
            f"{ratio and round(ratio, 2)}x fp32 DiLoCo loopback; final {r['final_val_loss']:.4f}; "
            f"{r['mb_per_worker']:.1f} MB/worker; load {r['load'][0]:.1f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--links", default="20mbit,5mbit", help="comma-separated testbed rates")
    parser.add_argument("--target", type=float, default=2.7763, help="the target loss (item 5's, quick tier)")
    parser.add_argument("--arms", default="", help="comma-separated: ps, ps-proc, ps-host (default: all three)")
    a = parser.parse_args()
    main(a.out, tuple(a.links.split(",")), a.target, tuple(x for x in a.arms.split(",") if x))
