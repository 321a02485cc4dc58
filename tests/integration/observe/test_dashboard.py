"""The live dashboard (islands.dashboard): the state it reads from a run directory, its read-only server, the
CLI's messages, a real headless browser on the page, and `islands train --dashboard 0` end to end."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.browser import needs_browser, render, screenshot
from islands.cli import main
from islands.dashboard import DashboardError, DashboardServer, RunReader, build_state, server as server_mod
from islands.observe import JsonLines

STEPS, EVERY = 40, 10


def val_loss(step: int) -> float:
    return 5.0 - 0.0123 * step


def sent_mb(rank: int, step: int) -> float:
    return step * (0.5 + 0.01 * rank)


def write_stream(run_dir: Path, rank: int, islands: int = 2, upto: int = STEPS) -> JsonLines:
    """A rank's live stream as islands' Logging callback writes it (islands.observe.callback)."""
    lg = JsonLines(run_dir / "live" / f"rank{rank}.jsonl")
    lg.log_params(
        {
            "strategy": "diloco",
            "task": "lm",
            "world.size": 2,
            "world.islands": islands,
            "world.rank": rank,
            "world.island": rank % islands,
            "interconnect": "gloo loopback: p2p 9.5 Gbit/s",
            "interconnect.p2p.bandwidth_gbit_s": 9.5,
            "baseline": "per worker: one process",
            "config.train.steps": STEPS,
            "config.checkpoint.every": 20,
        }
    )
    for step in range(0, upto + 1, EVERY):
        if step:
            lg.log_metrics(
                {
                    "train/loss": val_loss(step) + 0.1 + rank / 100,
                    "train/lr": 1e-3,
                    "comm/sent_mb": sent_mb(rank, step),
                    "time/elapsed_s": step * 0.1,
                    "time/blocked_s": step * 0.01 * (rank + 1),
                    "time/utilisation": 1 - 0.1 * (rank + 1),
                    "link/achieved_gbit_s": 0.5 + rank,
                    "train/tokens_per_s": 1000.0 + step,
                },
                step,
            )
        lg.log_metrics(
            {"val/loss": val_loss(step), "val/accuracy": 0.01 * step, "val/sent_mb": sent_mb(rank, step)}, step
        )
        if step and step % 20 == 0:
            lg.log_metrics({"ckpt/saves/local": step // 20, "ckpt/stall_s": 0.05 * step / 20}, step)
            lg.log_event(
                {"type": "checkpoint", "last_saved_step": step, "stall_s": 0.05 * step / 20, "saves.local": step // 20},
                step,
            )
    lg.log_event(
        {
            "type": "membership",
            "change.type": "failure",
            "change.epoch": 1,
            "change.gone": '["w9"]',
            "change.size": 2,
            "change.detected": time.time(),
            "change.stall_seconds": 0.4,
        },
        upto,
    )
    return lg


def write_record(run_dir: Path) -> dict:
    steps = list(range(0, STEPS + 1, EVERY))
    record = {
        "config": {"train": {"steps": STEPS}, "checkpoint": {"every": 20}},
        "world": {"size": 2, "islands": 2, "workers_per_island": 1},
        "interconnect": {"p2p": {"bandwidth_gbit_s": 9.5}},
        "interconnect_line": "gloo loopback: p2p 9.5 Gbit/s",
        "baseline": {"definition": "per worker: one process", "unit": "worker"},
        "comm": {"per_rank": [{"total_sent": sent_mb(r, STEPS) * 1e6, "busy_seconds": 2.0} for r in (0, 1)]},
        "series": {
            "train": [{"step": s, "loss": val_loss(s) + 0.1} for s in steps if s],
            "val": [
                {"step": s, "val_loss": val_loss(s), "val_accuracy": 0.01 * s, "mb_sent": sent_mb(0, s)} for s in steps
            ],
        },
        "summary": {
            "task": "lm",
            "strategy": "diloco",
            "workers": 2,
            "islands": 2,
            "steps": STEPS,
            "wall_seconds": 4.0,
            "final_val_loss": val_loss(STEPS),
            "final_val_accuracy": 0.4,
            "final_train_loss": val_loss(STEPS) + 0.1,
            "mb_sent_per_worker": 20.2,
            "tokens_per_second": 1040.0,
            "sync_blocked_seconds": 0.4,
        },
        "checkpoint": {
            "saves": {"local": 2},
            "last_saved_step": 40,
            "stall_seconds_total": 0.1,
            "levels": {"local": 20, "memory": 0, "remote": 0},
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - 5)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=1))
    return record


@pytest.fixture
def finished_run(tmp_path) -> tuple[Path, dict]:
    run_dir = tmp_path / "run"
    for rank in (0, 1):
        write_stream(run_dir, rank).close()
    return run_dir, write_record(run_dir)


@pytest.fixture
def serve():
    servers = []

    def start(run_dir, **kw) -> DashboardServer:
        srv = DashboardServer(run_dir, port=0, **kw).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def get(srv: DashboardServer, path: str, method: str = "GET", headers: dict | None = None, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), data


# ---- the state --------------------------------------------------------------------------------------
def test_a_finished_run_shows_run_json_numbers_and_the_live_series(finished_run):
    run_dir, record = finished_run
    s = build_state(run_dir)
    json.dumps(s, allow_nan=False)  # what /api/state sends
    summary = record["summary"]
    assert s["status"] == "finished" and s["source"] == "live" and s["step"] == STEPS
    n = s["numbers"]
    assert n["from"] == "run.json"
    assert n["val_loss"] == summary["final_val_loss"] and n["val_step"] == STEPS
    assert n["mb_sent_per_worker"] == summary["mb_sent_per_worker"]
    assert n["tokens_per_s"] == summary["tokens_per_second"]
    assert n["utilisation"] == pytest.approx((0.9 + 0.8) / 2) and n["utilisation_of"] == "mean of 2 rank(s)"
    assert s["val"]["source"] == "run.json"
    assert s["val"]["loss"] == [v["val_loss"] for v in record["series"]["val"]]
    assert s["val"]["sent_mb"] == [v["mb_sent"] for v in record["series"]["val"]]
    assert s["job"] == {
        "task": "lm",
        "strategy": "diloco",
        "workers": 2,
        "islands": 2,
        "steps_total": STEPS,
        "interconnect": "gloo loopback: p2p 9.5 Gbit/s",
        "baseline": "per worker: one process",
    }
    assert [r["name"] for r in s["ranks"]] == ["rank0", "rank1"]
    r1 = s["ranks"][1]
    assert r1["island"] == 1 and r1["utilisation"]["value"] == [0.8] * 4 and r1["link_gbit_s"]["value"] == [1.5] * 4
    assert r1["sent_mb"]["step"] == [10, 20, 30, 40] and r1["latest"]["sent_mb"] == sent_mb(1, STEPS)
    assert s["link_reference"]["p2p_gbit_s"] == 9.5
    ck = s["checkpoint"]
    assert ck["source"] == "run.json" and ck["saves"] == {"local": 2} and ck["last_saved_step"] == 40
    assert ck["stall_s"] == 0.1 and ck["levels"] == {"local": 20}
    m = s["membership"]
    assert [(r["island"], r["name"]) for r in m["rows"]] == [(0, "rank0"), (1, "rank1")]
    assert all(r["end"] >= r["start"] >= 0 for r in m["rows"])
    assert len(m["events"]) == 1 and m["events"][0]["type"] == "failure"  # both ranks logged it: shown once
    assert "w9 gone" in m["events"][0]["text"]


def test_a_running_run_shows_the_latest_live_numbers(tmp_path):
    run_dir = tmp_path / "run"
    for rank in (0, 1):
        write_stream(run_dir, rank, upto=20).close()
    s = build_state(run_dir)
    assert s["status"] == "running" and s["step"] == 20 and s["job"]["steps_total"] == STEPS
    n = s["numbers"]
    assert n["from"] == "live" and n["val_loss"] == val_loss(20) and n["val_step"] == 20
    assert n["mb_sent_per_worker"] == pytest.approx((sent_mb(0, 20) + sent_mb(1, 20)) / 2)
    assert n["train_loss"] == val_loss(20) + 0.1 and n["tokens_per_s"] == 1020.0
    assert s["val"] == {
        "step": [0, 10, 20],
        "loss": [val_loss(0), val_loss(10), val_loss(20)],
        "sent_mb": [sent_mb(0, 0), sent_mb(0, 10), sent_mb(0, 20)],
        "source": "rank0",
    }
    ck = s["checkpoint"]
    assert ck["source"] == "rank0" and ck["saves"] == {"local": 1} and ck["last_saved_step"] == 20
    assert ck["configured"] and ck["levels"] == {"local": 20}
    assert RunReader(run_dir).state(now=time.time() + 3600)["status"] == "stalled"


def test_a_run_of_an_older_version_shows_run_json_alone(tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    record = write_record(run_dir)
    s = build_state(run_dir)
    assert s["status"] == "finished" and s["source"] == "run.json"
    assert s["numbers"]["val_loss"] == record["summary"]["final_val_loss"]
    assert s["numbers"]["utilisation"] == pytest.approx(1 - 0.4 / 4.0) and s["numbers"]["utilisation_of"] == "rank 0"
    assert [r["name"] for r in s["ranks"]] == ["rank0", "rank1"]
    assert s["ranks"][0]["train_loss"]["value"] == [e["loss"] for e in record["series"]["train"]]
    assert s["ranks"][1]["link_gbit_s"]["value"] == [pytest.approx(sent_mb(1, STEPS) * 1e6 * 8 / 2.0 / 1e9)]
    assert [r["island"] for r in s["membership"]["rows"]] == [0, 1]
    assert build_state(tmp_path / "none")["status"] == "waiting"


def test_elastic_membership_records_give_rows_and_events(tmp_path):
    run_dir = tmp_path / "elastic-run"
    (run_dir / "elastic").mkdir(parents=True)
    t = 1_700_000_000.0
    for name, slot, (a, b) in (("w0", 0, (t, t + 30)), ("w1", 1, (t + 1, t + 12))):
        (run_dir / "elastic" / f"{name}.json").write_text(
            json.dumps(
                {
                    "name": name,
                    "slot": slot,
                    "syncs": [{"start": a, "seconds": 0.5}, {"start": b, "seconds": 0.5}],
                    "final": {
                        "epoch": 1,
                        "events": [
                            {
                                "type": "failure",
                                "epoch": 1,
                                "gone": ["w2"],
                                "size": 2,
                                "detected": t + 10,
                                "formed": t + 11,
                                "resumed": t + 11.5,
                                "stall_seconds": 1.5,
                            }
                        ],
                    },
                }
            )
        )
    s = build_state(run_dir)
    m = s["membership"]
    assert [(r["name"], r["start"], r["end"]) for r in m["rows"]] == [("w0", 0.0, 30.5), ("w1", 1.0, 12.5)]
    assert [(e["type"], e["t_s"]) for e in m["events"]] == [("failure", 10.0)]


def test_the_reader_waits_for_a_half_written_line_and_reads_only_what_was_appended(tmp_path):
    path = tmp_path / "run" / "live" / "rank0.jsonl"
    path.parent.mkdir(parents=True)
    line = json.dumps({"t": time.time(), "kind": "metrics", "step": 5, "metrics": {"val/loss": 3.25}})
    path.write_text(line[:20])
    reader = RunReader(tmp_path / "run")
    assert reader.state()["numbers"]["val_loss"] is None
    with open(path, "a") as f:
        f.write(line[20:] + "\n")
    assert reader.state()["numbers"]["val_loss"] == 3.25
    stream = next(iter(reader._streams.values()))
    assert stream.offset == path.stat().st_size
    path.write_text(json.dumps({"t": time.time(), "kind": "metrics", "step": 1, "metrics": {"val/loss": 9.0}}) + "\n")
    assert reader.state()["numbers"]["val_loss"] == 9.0  # a new, shorter file: read from the start


# ---- the server -------------------------------------------------------------------------------------
def test_the_server_answers_the_page_its_assets_and_the_state_and_nothing_else(finished_run, serve):
    run_dir, record = finished_run
    srv = serve(run_dir)
    assert srv.url == f"http://127.0.0.1:{srv.port}/"
    status, headers, body = get(srv, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'src="plotly.min.js"' in body and b'id="val-loss"' in body
    for asset in ("/dashboard.js", "/dashboard.css"):
        assert get(srv, asset)[0] == 200
    status, headers, body = get(srv, "/plotly.min.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript") and len(body) > 1_000_000
    assert body == server_mod.plotly_bundle().read_bytes()
    status, headers, body = get(srv, "/api/state?x=1")
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert json.loads(body)["numbers"]["val_loss"] == record["summary"]["final_val_loss"]
    status, headers, body = get(srv, "/", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    for path in (
        "/../run.json",
        "/run.json",
        "/live/rank0.jsonl",
        "/api/state/../../run.json",
        "//etc/passwd",
        "/%2e%2e/run.json",
        "/config.json",
        "/api",
    ):
        assert get(srv, path)[0] == 404, path
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, _ = get(srv, "/api/state", method=method, body=b"{}")
        assert status == 405 and headers["Allow"] == "GET, HEAD", method
    # bound to loopback, it answers to loopback names only (no DNS rebinding from a web page)
    assert get(srv, "/api/state", headers={"Host": "evil.example:80"})[0] == 403
    assert get(srv, "/api/state", headers={"Host": f"localhost:{srv.port}"})[0] == 200


def test_the_state_follows_lines_appended_while_the_server_runs(tmp_path, serve):
    run_dir = tmp_path / "run"
    lg = write_stream(run_dir, 0, upto=10)
    srv = serve(run_dir)
    before = json.loads(get(srv, "/api/state")[2])
    assert before["status"] == "running" and before["step"] == 10
    lg.log_metrics({"val/loss": 1.5, "val/sent_mb": 42.0}, 30)
    lg.close()
    after = json.loads(get(srv, "/api/state")[2])
    assert after["step"] == 30 and after["numbers"]["val_loss"] == 1.5 and after["rev"] != before["rev"]
    assert after["val"]["sent_mb"][-1] == 42.0


def test_plotly_missing_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(server_mod, "find_spec", lambda name: None)
    with pytest.raises(DashboardError, match=r"islands\[dashboard\]"):
        DashboardServer(tmp_path, port=0)


# ---- the CLI ------------------------------------------------------------------------------------------
@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_busy_port_is_one_clear_line_and_exit_2(busy_port, finished_run, capsys):
    run_dir, _ = finished_run
    with pytest.raises(SystemExit) as e:
        main(["dashboard", str(run_dir), "--port", str(busy_port)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"dashboard port {busy_port} on 127.0.0.1 is already in use" in err and "--port 0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # islands train --dashboard: refused before any worker starts
    with pytest.raises(SystemExit) as e:
        main(
            ["train", "--workers", "2", "--steps", "2", "--run-dir", str(run_dir / "t"), "--dashboard", str(busy_port)]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"port {busy_port}" in err and "--dashboard 0" in err and "Traceback" not in err
    assert not (run_dir / "t").exists()


def test_cli_input_errors_exit_2(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        main(["dashboard", str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["dashboard", str(tmp_path), "--port", "70000"])
    assert e.value.code == 2 and "0..65535" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")  # a torchrun worker: no launcher to serve it
    with pytest.raises(SystemExit) as e:
        main(["train", "--workers", "2", "--run-dir", str(tmp_path / "r"), "--dashboard"])
    assert e.value.code == 2 and "islands dashboard" in capsys.readouterr().err


def test_the_dashboard_command_serves_until_interrupted(finished_run, monkeypatch, capsys):
    run_dir, record = finished_run
    seen = {}

    def serve_until_ctrl_c(self):  # in place of serving forever: one request, then Ctrl-C
        self.start()
        seen["state"] = json.loads(get(self, "/api/state")[2])
        self.stop()
        raise KeyboardInterrupt

    monkeypatch.setattr(DashboardServer, "serve_forever", serve_until_ctrl_c)
    with pytest.raises(SystemExit) as e:
        main(["dashboard", str(run_dir), "--port", "0", "--host", "0.0.0.0"])
    assert e.value.code == 0
    out = capsys.readouterr()
    assert re.search(r"http://127\.0\.0\.1:\d+/", out.out) and "not on loopback" in out.err
    assert seen["state"]["numbers"]["val_loss"] == record["summary"]["final_val_loss"]


# ---- a real browser ------------------------------------------------------------------------------------
@needs_browser
def test_the_page_renders_in_a_browser_with_run_json_numbers(finished_run, serve):
    run_dir, record = finished_run
    srv = serve(run_dir)
    dom = render(srv.url)
    summary = record["summary"]

    def text(element_id: str) -> str:
        m = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
        assert m, f"no element #{element_id} in the rendered page"
        return m.group(1)

    assert text("val-loss") == f"{summary['final_val_loss']:.4f}"
    assert text("mb-sent") == f"{summary['mb_sent_per_worker']:.3f}"
    assert text("status") == "finished" and text("step") == f"{STEPS} / {STEPS}"
    assert text("interconnect") == record["interconnect_line"]
    assert text("error") == ""
    assert dom.count('class="main-svg"') >= 5  # Plotly drew the charts
    shot = screenshot(srv.url, "dashboard.png")
    assert shot.stat().st_size > 10_000


# ---- islands train --dashboard 0, end to end --------------------------------------------------------------
@needs_browser
def test_train_with_a_dashboard_end_to_end(tmp_path, serve):
    run_dir = tmp_path / "job"
    cmd = [
        sys.executable,
        "-m",
        "islands",
        "train",
        "--workers",
        "2",
        "--steps",
        "6",
        "--d-model",
        "16",
        "--n-layers",
        "1",
        "--n-heads",
        "2",
        "--context",
        "16",
        "--global-batch",
        "4",
        "--eval-batches",
        "1",
        "--eval-every",
        "3",
        "--no-progress",
        "--no-probe",
        "--run-dir",
        str(run_dir),
        "--dashboard",
        "0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        first = proc.stderr.readline()  # printed before the workers start
        m = re.search(r"dashboard at (http://127\.0\.0\.1:(\d+)/)", first)
        assert m, first
        conn = http.client.HTTPConnection("127.0.0.1", int(m.group(2)), timeout=10)
        conn.request("GET", "/api/state")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["run_dir"] == str(run_dir)  # served while the job runs
        conn.close()
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert f"islands dashboard {run_dir}" in err
    record = json.loads((run_dir / "run.json").read_text())
    s = build_state(run_dir)
    assert s["status"] == "finished" and s["numbers"]["val_loss"] == record["summary"]["final_val_loss"]
    assert [r["name"] for r in s["ranks"]] == ["rank0", "rank1"] and s["source"] == "live"
    # the real run's page in a real browser: its numbers are run.json's
    srv = serve(run_dir)
    dom = render(srv.url)
    for element_id, value in (
        ("val-loss", f"{record['summary']['final_val_loss']:.4f}"),
        ("mb-sent", f"{record['summary']['mb_sent_per_worker']:.3f}"),
        ("status", "finished"),
    ):
        m = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
        assert m and m.group(1) == value, (element_id, m and m.group(1), value)
    assert dom.count('class="main-svg"') >= 5
    screenshot(srv.url, "dashboard-real-run.png")


def test_the_dashboard_and_read_lines_agree_on_a_damaged_stream(tmp_path):
    from islands.observe import read_lines

    path = tmp_path / "run" / "live" / "rank0.jsonl"
    path.parent.mkdir(parents=True)
    good = [{"t": 1.0 + i, "kind": "metrics", "step": i, "metrics": {"val/loss": 5.0 - i}} for i in range(3)]
    torn = json.dumps(good[1])[:17]  # a writer killed mid-line, then restarted on the next line
    path.write_text(json.dumps(good[0]) + "\n" + torn + "\n" + json.dumps(good[2]) + "\n" + '{"t": 9, "ki')
    lines = read_lines(path)
    assert lines == [good[0], good[2]]
    assert RunReader(tmp_path / "run").state()["numbers"]["val_loss"] == good[2]["metrics"]["val/loss"]
