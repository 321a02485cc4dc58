"""Links and collective costs: alpha-beta per collective kind, from a link spec or fitted to a timed probe.

A collective's time is modelled as alpha + beta * B, with B the bytes the comm ledger records as *sent* by one rank
for it (islands.runtime.comm's payload convention). From a link spec (rate R bit/s, one-way latency L) over a ring of
n ranks, as gloo runs them:
  all_reduce      2(n-1) steps, each B/n bytes:          alpha = 2(n-1) L,  beta = 2(n-1)/n * 8/R
  all_gather      n-1 steps of the own chunk B:          alpha = (n-1) L,   beta = (n-1) * 8/R
  reduce_scatter  n-1 steps; B is already the n-1 slices: alpha = (n-1) L,   beta = 8/R
From a probe (`probe_collectives`: 2 gloo processes on this machine) alpha and beta are fitted by least squares on
the measured times of several sizes, per kind; other group sizes scale them by the ring's step count.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from islands.plan.profile import cache_dir
from islands.runtime.netns import enter as enter_netns
from islands.testbed import state
from islands.testbed.model import Testbed
from islands.testbed.spec import parse_rate

KINDS = ("all_reduce", "all_gather", "reduce_scatter")
_LINK = re.compile(r"^\s*([0-9.]+)\s*(kbit|mbit|gbit)\s*(?:,\s*([0-9.]+)\s*(us|ms|s)\s*)?$", re.IGNORECASE)
_RATE_BITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
PROBE_BYTES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)  # spans latency- and bandwidth-bound sizes on loopback


class LinkError(ValueError):
    """A link that does not parse or cannot be found; the message lists what would."""


@dataclass(frozen=True)
class AlphaBeta:
    """t(B) = alpha_s + beta_s_per_byte * B for one collective kind on one group; `rel_error`: the fit's relative RMS
    residual on the points it came from (0 for a spec, which has none)."""

    alpha_s: float
    beta_s_per_byte: float
    source: str
    rel_error: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * nbytes if nbytes > 0 else 0.0


def fit_alpha_beta(sizes: list[float], times: list[float], source: str = "fit") -> AlphaBeta:
    """Line through (bytes, seconds) minimising the *relative* squared error (weights 1/t^2: a latency-bound small
    size counts as much as a bandwidth-bound large one), both coefficients kept >= 0 (a negative one is noise)."""
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError(f"need timings at >= 2 distinct sizes; got sizes {sizes}")
    w = [1.0 / max(t, 1e-12) ** 2 for t in times]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, times)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    beta = max(sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, times)) / sxx, 0.0)
    alpha = my - beta * mx
    if alpha < 0:  # refit through the origin
        alpha = 0.0
        beta = sum(wi * x * y for wi, x, y in zip(w, sizes, times)) / sum(wi * x * x for wi, x in zip(w, sizes))
    rel = math.sqrt(sum(((alpha + beta * x) - y) ** 2 / max(y, 1e-12) ** 2 for x, y in zip(sizes, times)) / len(sizes))
    return AlphaBeta(alpha, beta, source, rel)


def _ring_steps(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth factor on the ledger's sent bytes) of a ring collective over n ranks."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind == "all_gather":
        return n - 1, n - 1
    if kind == "reduce_scatter":
        return n - 1, 1.0
    raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class Link:
    """A link between ranks: `rate_bps` bits per second each way, `latency_s` one-way. `fitted`: alpha-beta per kind
    measured on 2 ranks (a probe), used instead of the formulas when present."""

    rate_bps: float
    latency_s: float
    source: str
    fitted: dict[str, AlphaBeta] = field(default_factory=dict)

    def cost(self, kind: str, n: int) -> AlphaBeta:
        """Alpha-beta of `kind` over a ring of n ranks on this link."""
        steps, factor = _ring_steps(kind, n)
        if kind in self.fitted:  # measured at n = 2: scale by the ring's step counts
            f = self.fitted[kind]
            s2, f2 = _ring_steps(kind, 2)
            return AlphaBeta(f.alpha_s * steps / s2, f.beta_s_per_byte * factor / f2, f.source, f.rel_error)
        return AlphaBeta(steps * self.latency_s, factor * 8.0 / self.rate_bps, self.source)

    def seconds(self, kind: str, n: int, nbytes: float) -> float:
        return 0.0 if n < 2 else self.cost(kind, n).seconds(nbytes)

    def describe(self) -> str:
        if self.fitted:
            ar = self.fitted.get("all_reduce")
            if ar is not None:
                gbit = 8 / max(ar.beta_s_per_byte, 1e-18) / 1e9
                return f"{self.source}: all_reduce {ar.alpha_s * 1e6:.0f} us + {gbit:.2f} Gbit/s"
            return self.source
        return f"{self.source}: {self.rate_bps / 1e6:g} Mbit/s, {self.latency_s * 1e3:g} ms"


def parse_rate_latency(text: str) -> Link | None:
    """'100mbit' or '100mbit,20ms' (latency: us, ms or s) -> a Link; None when `text` is not of that form."""
    m = _LINK.match(text)
    if m is None:
        return None
    rate = float(m.group(1)) * _RATE_BITS[m.group(2).lower()]
    latency = float(m.group(3)) * _TIME_S[m.group(4).lower()] if m.group(3) else 0.0
    if rate <= 0:
        raise LinkError(f"link {text!r}: the rate must be > 0")
    return Link(rate, latency, text.strip())


def testbed_link(name: str) -> Link | None:
    """The rate a testbed made by `islands testbed up` shapes its links to (its measured goodput when it has one)."""
    data = state.load(name)
    if data is None:
        return None
    measured = (data.get("measured") or {}).get("goodput_mbit")
    rate = float(measured) * 1e6 if measured else float(parse_rate(data["rate"]))
    return Link(rate, 0.0, f"testbed {name} ({'measured' if measured else 'shaped'} {rate / 1e6:g} Mbit/s)")


def parse_link(text: str, probe=None) -> Link:
    """A link from the user's words: RATE[,LATENCY] ('100mbit', '1gbit,5ms'), a testbed's name, or 'measured' (a
    probe on this machine: `probe()` -> Link). LinkError names the forms when none fits."""
    text = text.strip()
    if text == "measured":
        return (probe or probe_link)()
    link = parse_rate_latency(text)
    if link is not None:
        return link
    if re.fullmatch(r"[a-z][a-z0-9-]{0,15}", text):
        try:
            bed = testbed_link(text)
        except (OSError, ValueError, KeyError):
            bed = None
        if bed is not None:
            return bed
    raise LinkError(
        f"link {text!r} is not understood: give a rate and an optional one-way latency ('100mbit', '1gbit,5ms', "
        "'500kbit,40ms'; units kbit/mbit/gbit and us/ms/s), the name of a testbed made by `islands testbed up`, "
        "or 'measured' (a gloo probe on this machine)"
    )


# ---- the probe: 2 gloo processes on this machine, or on a testbed's hosts 0 and 1 ------------------------------------
def _probe_worker(
    rank: int, init: str, sizes: tuple[int, ...], reps: int, out: str, hosts: tuple[dict, ...] = ()
) -> None:
    if hosts:  # a testbed: this process in its host's namespace, gloo bound to the host's shaped link
        enter_netns(hosts[rank]["netns"])
        os.environ["GLOO_SOCKET_IFNAME"] = hosts[rank]["ifname"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
    try:
        for nbytes in sizes:
            numel = nbytes // 4
            x = torch.ones(numel)
            gathered = torch.empty(2 * numel)
            half = torch.empty(numel // 2)
            calls: dict[str, tuple[Callable[[], object], int]] = {
                # each timed with the ledger's sent bytes for it (runtime/comm.py)
                "all_reduce": (partial(dist.all_reduce, x), nbytes),
                "all_gather": (partial(dist.all_gather_into_tensor, gathered, x), nbytes),
                "reduce_scatter": (partial(dist.reduce_scatter_tensor, half, x), (numel // 2) * 4),
            }
            for kind, (fn, sent) in calls.items():
                fn()  # warm-up
                times = []
                for _ in range(reps):
                    dist.barrier()
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                results[kind].append((sent, statistics.median(times)))
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def probe_collectives(
    sizes: tuple[int, ...] = PROBE_BYTES, reps: int = 9, testbed: Testbed | None = None
) -> dict[str, list[tuple[int, float]]]:
    """Median seconds of each collective kind at each size, between 2 gloo processes on this machine (loopback), or
    on `testbed`'s hosts 0 and 1 (its shaped link, with what TCP and gloo really get through it)."""
    if testbed is not None:
        hosts = tuple({"netns": h.netns, "ifname": h.ifname} for h in testbed.hosts[:2])
        init = f"tcp://{testbed.master_addr}:{testbed.free_port(0)}"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        hosts, init = (), f"tcp://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "probe.pt")
        mp.spawn(_probe_worker, args=(init, sizes, reps, out, hosts), nprocs=2, join=True)
        return torch.load(out)


def link_from_probe(timings: dict[str, list[tuple[int, float]]], source: str) -> Link:
    fitted = {k: fit_alpha_beta([b for b, _ in v], [t for _, t in v], source) for k, v in timings.items()}
    ar = fitted["all_reduce"]
    rate = 8.0 / ar.beta_s_per_byte if ar.beta_s_per_byte > 0 else 1e12
    return Link(rate, ar.alpha_s / 2, source, fitted)


def probe_link(cache: Path | None = None, refresh: bool = False, testbed: Testbed | None = None) -> Link:
    """The probe's link, its timings cached per host (starting 2 processes costs more than the probe itself on a
    busy machine) and testbed; `refresh` measures again. `testbed`: probe between its hosts 0 and 1 instead of on
    loopback (a shaped link carries less than its rate: TCP's and gloo's own pace through the shaper)."""
    where = f"testbed-{testbed.name}-{testbed.rate}" if testbed is not None else "loopback"
    path = (cache or cache_dir()) / f"probe-{socket.gethostname()}-{where}-torch{torch.__version__}.json"
    timings = None
    cached = path.is_file() and not refresh
    if cached:
        timings = {k: [(int(b), float(t)) for b, t in v] for k, v in json.loads(path.read_text()).items()}
    if timings is None:
        timings = probe_collectives(testbed=testbed)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(timings))
    source = f"testbed {testbed.name} ({testbed.rate})" if testbed is not None else "loopback"
    return link_from_probe(timings, f"measured: gloo {source}, 2 processes" + (", cached" if cached else ""))
