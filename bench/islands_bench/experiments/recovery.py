"""recovery (issue #20 item 5): how fast a joiner receives the global state over a shaped link.

A joiner in testbed host 0 fetches a state of S MB (fp32 tensors drawn N(0, 0.02), a model plus an
outer-momentum buffer; 100 MB full, 20 MB quick) with islands.runtime.elastic.recovery from 1, 2 and 3 serving
peers in hosts 1..3, each a separate process serving its own copy of the same state. Measured at the
joiner: seconds from the first connection to the tree rebuilt (manifest, every chunk checked, tensors
ready), as payload Mbit/s against the configured link rate (goal: >= 80%).

Which link limits it (docs/testbed.md's star): every host has one veth to the hub, shaped on both ends
(the host's tbf limits its upload, the hub port's tbf its download). From one peer the path is that
peer's upload and the joiner's download, both at the rate; from k peers the joiner's download is the
limit (it carries all k streams) while each peer's upload carries 1/k. So on equal links more peers
cannot beat one; they pay off when the peers' uploads are slower than the joiner's download, which a
second part measures by re-shaping the serving hosts' uploads to 40 Mbit/s (3 x 40 > 100).

Side by side in the same testbed: today's transport for a join before this module, one gloo broadcast
of the same number of bytes from one member (host 1) to the joiner (host 0), timed at the joiner; the
checkpoint codec per tensor (lossless, SOTA-437) from one peer; and one TCP stream measured by the
testbed (`measure_rate`) as the link's achievable goodput.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from islands_bench.harness import BenchContext, experiment
from islands_bench.plots import figure

RATE = "100mbit"
SLOW_UPLINK = "40mbit"  # serving hosts' upload in part 2: three of them together exceed the joiner's 100
GOAL = 0.8


# ---- worker processes (run inside testbed hosts) ----------------------------------------------------
def make_state(mb: int, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    n = mb * 1_000_000 // 4
    tensor_elems = 1 << 20  # 4 MB tensors, like a transformer's weight matrices
    sizes = [tensor_elems] * (n // tensor_elems) + ([n % tensor_elems] if n % tensor_elems else [])
    cut = len(sizes) * 3 // 4  # three quarters model, one quarter outer momentum
    weights = {f"layer{i}.weight": torch.randn(k, generator=g) * 0.02 for i, k in enumerate(sizes[:cut])}
    momentum = [torch.randn(k, generator=g) * 1e-3 for k in sizes[cut:]]
    return {"model": weights, "strategy": {"outer": {"momentum": momentum, "rounds": 12}}, "step": 600}


def _serve(out: str, mb: str, host: str, codec: str) -> None:
    import torch

    from islands.checkpoint.codec import TensorCodec
    from islands.control import StateImage, StateServer

    torch.set_num_threads(1)
    state = make_state(int(mb))
    start = time.perf_counter()
    image = StateImage.build(state, codec=TensorCodec() if codec == "codec" else None)
    built = time.perf_counter() - start
    server = StateServer(image, host=host, secret=b"bench")
    Path(out + ".tmp").write_text(
        json.dumps(
            {
                "address": f"{server.address[0]}:{server.address[1]}",
                "digest": image.manifest.digest,
                "build_s": built,
                "payload_bytes": image.manifest.total,
            }
        )
    )
    os.replace(out + ".tmp", out)
    sys.stdin.read()  # serve until the bench closes our stdin
    server.close()


def _fetch(out: str, *peers: str) -> None:
    from islands.checkpoint.codec import decode_tensor
    from islands.control import fetch_state

    state, report = fetch_state(list(peers), secret=b"bench", timeout=60, decode=decode_tensor)
    Path(out).write_text(
        json.dumps(
            {
                "seconds": report.seconds,
                "payload_bytes": report.payload_bytes,
                "per_peer": report.per_peer,
                "refetched": report.refetched,
                "digest": report.digest,
                "step": state["step"],
            }
        )
    )


def _gloo(out: str, nbytes: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    blob = torch.zeros(int(nbytes), dtype=torch.uint8)
    if dist.get_rank() == 0:
        blob.fill_(7)
    dist.barrier()
    start = time.perf_counter()
    dist.broadcast(blob, src=0)
    seconds = time.perf_counter() - start
    if dist.get_rank() == 1:
        assert int(blob[-1]) == 7
        Path(out).write_text(json.dumps({"seconds": seconds, "payload_bytes": int(nbytes)}))
    dist.barrier()
    dist.destroy_process_group()


# ---- orchestration ------------------------------------------------------------------------------------
def _worker(bed, host: int, args: list[str], env: dict | None = None, stdin=None) -> subprocess.Popen:
    argv = bed.wrap(host, [sys.executable, "-m", "islands_bench.experiments.recovery", *args])
    return subprocess.Popen(
        argv,
        env={**os.environ, **bed.env(host), "OMP_NUM_THREADS": "1", **(env or {})},
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"recovery bench worker failed:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"recovery bench worker gave no result within {timeout:.0f} s")
        time.sleep(0.05)
    return json.loads(path.read_text())


class _Servers:
    """Serving processes, one per host in `hosts`, each with its own copy of the same state."""

    def __init__(self, bed, work: Path, hosts: list[int], mb: int, codec: str):
        self.procs, self.info = [], []
        for h in hosts:
            out = work / f"serve-{codec}-h{h}.json"
            out.unlink(missing_ok=True)
            self.procs.append(
                (_worker(bed, h, ["serve", str(out), str(mb), bed.hosts[h].ip, codec], stdin=subprocess.PIPE), out)
            )
        self.info = [_wait_file(out, p) for p, out in self.procs]
        if len({i["digest"] for i in self.info}) != 1:
            raise RuntimeError("the serving peers built different states; the bench's state is not deterministic")

    def close(self) -> None:
        for p, _ in self.procs:
            try:
                p.stdin.close()
                p.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()


def _fetch_row(ctx, bed, work: Path, label: str, servers: _Servers, peers: int, link: str) -> dict:
    out = work / f"fetch-{label}.json"
    out.unlink(missing_ok=True)
    with ctx.arm(label):
        proc = _worker(bed, 0, ["fetch", str(out), *[i["address"] for i in servers.info[:peers]]])
        got = _wait_file(out, proc)
        proc.wait(timeout=60)
    mbit = got["payload_bytes"] * 8 / got["seconds"] / 1e6
    return {
        "run": label,
        "transport": "recovery",
        "peers": peers,
        "link": link,
        "payload_MB": got["payload_bytes"] / 1e6,
        "seconds": got["seconds"],
        "payload_mbit_s": mbit,
        "chunks_per_peer": "/".join(str(p["chunks"]) for p in got["per_peer"].values()),
        "refetched": got["refetched"],
        "server_build_s": max(i["build_s"] for i in servers.info[:peers]),
    }


def _gloo_row(ctx, bed, work: Path, nbytes: int) -> dict:
    out = work / "gloo.json"
    out.unlink(missing_ok=True)
    port = bed.free_port(1)
    with ctx.arm("gloo broadcast"):
        procs = [
            _worker(
                bed,
                host,
                ["gloo", str(out), str(nbytes)],
                env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": bed.hosts[1].ip, "MASTER_PORT": str(port)},
            )
            for rank, host in ((0, 1), (1, 0))
        ]
        logs = [p.communicate(timeout=600)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("gloo broadcast failed:\n" + "\n".join(log[-2000:] for log in logs))
    got = json.loads(out.read_text())
    return {
        "run": "gloo broadcast (today's join transport)",
        "transport": "gloo",
        "peers": 1,
        "link": RATE,
        "payload_MB": nbytes / 1e6,
        "seconds": got["seconds"],
        "payload_mbit_s": nbytes * 8 / got["seconds"] / 1e6,
        "chunks_per_peer": "",
        "refetched": 0,
        "server_build_s": 0.0,
    }


def _shape_upload(bed, host: int, rate: str) -> None:
    """Re-shape one host's upload (its own veth's tbf); the hub side (its download) keeps the testbed rate."""
    from islands.testbed import parse_rate

    bps = parse_rate(rate)
    burst = max(8 * 1514, 64 * 1024 * bps // 100_000_000)  # docs/testbed.md's shape: ~5 ms of traffic
    limit = burst + bps // 8 // 10  # + 100 ms of queue, as the testbed's own
    subprocess.run(
        bed.wrap(
            host,
            [
                "tc",
                "qdisc",
                "replace",
                "dev",
                bed.hosts[host].ifname,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(burst),
                "limit",
                str(limit),
            ],
        ),
        check=True,
    )


def _plot(result, path):
    rows = result["rows"]
    with figure(path, 1, 1, figsize=(9, 4)) as (fig, ax):
        ax.barh([r["run"] for r in rows], [r["payload_mbit_s"] for r in rows])
        ax.axvline(100 * GOAL, color="k", ls="--", lw=0.8, label=f"goal: {GOAL:.0%} of 100 Mbit/s")
        ax.set_xlabel("payload Mbit/s at the joiner")
        ax.tick_params(axis="y", labelsize=7)
        ax.legend(fontsize=7)
        fig.suptitle(
            f"recovery{' (quick)' if result['quick'] else ''}: {result['state_MB']} MB state, testbed {RATE}",
            fontsize=8,
        )


@experiment(
    "recovery",
    practices=("SOTA-931",),
    help="live recovery: a joiner fetches a 100 MB state from 1-3 peers over a 100 Mbit/s testbed link in "
    "checksummed chunks, vs the link rate and a gloo broadcast",
)
def recovery(ctx: BenchContext) -> dict:
    from islands import testbed

    mb = 2 if ctx.smoke else 20 if ctx.quick else 100
    ctx.plan(7)
    work = ctx.out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    with ctx.testbed(RATE, hosts=4) as bed:
        measured = testbed.measure_rate(bed, src=1, dst=0, seconds=2.0)
        raw = _Servers(bed, work, [1, 2, 3], mb, "raw")
        try:
            for peers in (1, 2, 3):
                rows.append(_fetch_row(ctx, bed, work, f"{peers} peer{'s' if peers > 1 else ''}", raw, peers, RATE))
            for h in (1, 2, 3):
                _shape_upload(bed, h, SLOW_UPLINK)
            slow = f"peers' upload {SLOW_UPLINK}, joiner's download {RATE}"
            for peers in (1, 3):
                rows.append(
                    _fetch_row(
                        ctx, bed, work, f"{peers} peer{'s' if peers > 1 else ''}, slow uplinks", raw, peers, slow
                    )
                )
            for h in (1, 2, 3):
                _shape_upload(bed, h, RATE)
        finally:
            raw.close()
        coded = _Servers(bed, work, [1], mb, "codec")
        try:
            row = _fetch_row(ctx, bed, work, "1 peer, checkpoint codec", coded, 1, RATE)
            row["wire_MB"] = coded.info[0]["payload_bytes"] / 1e6
            row["payload_MB"] = mb  # the state's raw size: the rate counts what the joiner ends up holding
            row["payload_mbit_s"] = mb * 1e6 * 8 / row["seconds"] / 1e6
            rows.append(row)
        finally:
            coded.close()
        rows.append(_gloo_row(ctx, bed, work, int(rows[0]["payload_MB"] * 1e6)))
        interconnect = bed.record()
    limit = 100.0
    for r in rows:
        r["of_link"] = r["payload_mbit_s"] / limit
        r["of_tcp_goodput"] = r["payload_mbit_s"] / measured["goodput_mbit"]
    by = {r["run"]: r for r in rows}
    one, three, gloo = by["1 peer"], by["3 peers"], by["gloo broadcast (today's join transport)"]
    s1, s3 = by["1 peer, slow uplinks"], by["3 peers, slow uplinks"]
    codec = by["1 peer, checkpoint codec"]
    headline = [
        f"{mb} MB state over testbed links of {RATE} (tbf, no latency emulated): from 1 peer "
        f"{one['payload_mbit_s']:.1f} Mbit/s of payload = {one['of_link']:.0%} of the link "
        f"(goal >= {GOAL:.0%}: {'met' if one['of_link'] >= GOAL else 'NOT met'}), {one['seconds']:.2f} s; "
        f"2 peers {by['2 peers']['of_link']:.0%}, 3 peers {three['of_link']:.0%} (the joiner's download is the "
        f"limit); one TCP stream measured {measured['goodput_mbit']:.1f} Mbit/s goodput",
        f"same bytes by one gloo broadcast (the old join transport, host 1 -> host 0): {gloo['payload_mbit_s']:.1f} "
        f"Mbit/s = {gloo['of_link']:.0%}; recovery from 1 peer / gloo = "
        f"{one['payload_mbit_s'] / gloo['payload_mbit_s']:.2f}x",
        f"peers' uploads re-shaped to {SLOW_UPLINK} (joiner's download {RATE}): 1 peer {s1['payload_mbit_s']:.1f} "
        f"Mbit/s, 3 peers {s3['payload_mbit_s']:.1f} Mbit/s ({s3['payload_mbit_s'] / s1['payload_mbit_s']:.2f}x; "
        f"chunks per peer {s3['chunks_per_peer']})",
        f"checkpoint codec per tensor (fp32 N(0, 0.02)): {codec['wire_MB']:.1f} MB on the wire for {mb} MB, "
        f"{codec['seconds']:.2f} s vs {one['seconds']:.2f} s raw (encode {codec['server_build_s']:.2f} s at the "
        f"peer, not in the time; decode is)",
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (machine shared with other jobs)",
    ]
    return {
        "rows": rows,
        "headline": headline,
        "plot": _plot,
        "state_MB": mb,
        "interconnect": [
            f"testbed {RATE} (tbf on both veth ends, star through a hub; latency not emulated); "
            f"one TCP stream host 1 -> host 0: {measured['goodput_mbit']:.1f} Mbit/s goodput, "
            f"{measured['wire_mbit']:.1f} on the wire"
        ],
        "testbed": interconnect,
    }


if __name__ == "__main__":
    {"serve": _serve, "fetch": _fetch, "gloo": _gloo}[sys.argv[1]](*sys.argv[2:])
