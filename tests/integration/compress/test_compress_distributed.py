"""Two gloo ranks: compress_and_average and the DDP hook (several buckets), bytes == analytic."""

import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.procs import forkserver
from harness.world import leave_group
from islands.compress import (
    ErrorFeedback,
    MajorityVote,
    PowerSGD,
    TopK,
    analytic_nbytes,
    compress_and_average,
    ddp_comm_hook,
    parse_compressor,
)
from islands.compress.average import FINITE_FLAG_NBYTES
from islands.runtime.comm import Comm, CommLedger

AVG_SPECS = [
    "none",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "qsgd:levels=8",
    "randomk:ratio=0.3,seed=1",
    "topk:ratio=0.2,warmup=1,stage_steps=1",
    "powersgd:rank=2",
    "powersgd:rank=2,start=1",
    "powersgd:rank=2,bits=16,dense_bits=16",
    "powersgd:rank=2,bits=8",
    "sign",
]
DDP_SPECS = ["none", "powersgd:rank=2", "powersgd:rank=2,bits=8", "topk:ratio=0.2,warmup=0", "int8", "sign"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )


def _inputs(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {
        "w": torch.randn(12, 10, generator=g),
        "b": torch.randn(10, generator=g),
        "empty": torch.zeros(0, 3),
        "nc": torch.randn(6, 5, generator=g).t(),
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),
    }


def _avg_worker(rank, port, out_dir):
    try:
        _init(rank, port)
        comm = Comm(None, CommLedger())
        results = {}
        for spec in AVG_SPECS:
            c = parse_compressor(spec)
            into, in_place = parse_compressor(spec), parse_compressor(spec)  # twins fed the same steps
            for step in range(3):
                tensors = _inputs(rank, step)
                dest = {n: torch.full_like(t, 7.0) for n, t in tensors.items()}
                got = compress_and_average(tensors, comm, into, out=dest)
                own = {n: t.clone() for n, t in tensors.items()}
                got_in_place = compress_and_average(own, comm, in_place, out=own)
                comm.ledger.reset()
                out = compress_and_average(tensors, comm, c)
                results[(spec, step, "out")] = (
                    all(got[n] is dest[n] and torch.equal(got[n], out[n]) for n in out),
                    all(got_in_place[n] is own[n] and torch.equal(own[n], out[n]) for n in out),
                )
                inner = c.inner if isinstance(c, ErrorFeedback) else c
                kw = {"step": step} if isinstance(inner, (TopK, PowerSGD)) else {}
                results[(spec, step)] = (
                    out,
                    comm.ledger.total_sent,
                    analytic_nbytes(tensors, c, **kw),
                    comm.ledger.total_received,
                )
            if spec.startswith("powersgd"):
                results[(spec, "Q")] = c.inner.states["w"]["Q"]
        torch.save(results, os.path.join(out_dir, f"avg{rank}.pt"))
        leave_group()
    except Exception:
        with open(os.path.join(out_dir, f"err{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _ddp_worker(rank, port, out_dir):
    try:
        _init(rank, port)
        from torch.nn.parallel import DistributedDataParallel as DDP

        results = {}
        # every spec with the worker thread (the default), and PowerSGD once more inside the hook
        for spec, overlap in [(s, True) for s in DDP_SPECS] + [("powersgd:rank=2", False)]:
            torch.manual_seed(0)
            net = _Net()
            comm = Comm(None, CommLedger())
            c = parse_compressor(spec)
            model = DDP(net, bucket_cap_mb=0.004)  # ~4 KB buckets: several buckets for a tiny net
            state, hook = ddp_comm_hook(c, comm, net.named_parameters(), overlap=overlap)
            buckets = set()
            calls = [0]

            def counting(st, bucket, hook=hook, buckets=buckets, calls=calls):
                buckets.add((len(buckets), bucket.index(), len(bucket.parameters())))
                calls[0] += 1
                return hook(st, bucket)

            model.register_comm_hook(state, counting)
            steps = []
            for step in range(3):  # DDP rebuilds its buckets after the first step
                g = torch.Generator().manual_seed(10 * rank + step)
                x = torch.randn(8, 16, generator=g)
                model.zero_grad()
                comm.ledger.reset()
                calls[0] = 0
                model(x).pow(2).mean().backward()
                local = torch.autograd.grad(net(x).pow(2).mean(), list(net.parameters()))
                # plus the 4-byte NaN/Inf agreement of every bucket's exchange
                analytic = (
                    sum(c.payload_nbytes(p.shape, p.dtype) for p in net.parameters()) + FINITE_FLAG_NBYTES * calls[0]
                )
                steps.append(
                    (
                        [p.grad.clone() for p in net.parameters()],
                        [g.clone() for g in local],
                        comm.ledger.total_sent,
                        analytic,
                    )
                )
            results[spec if overlap else f"{spec}|inline"] = (
                steps,
                max(i for _, i, _ in buckets) + 1,
                state.state_dict(),
            )
            state.close()
        # policy: a NaN gradient raises, naming the parameter (both ranks see it, so neither waits)
        net = _Net()
        model = DDP(net, bucket_cap_mb=0.004)
        state, hook = ddp_comm_hook(
            parse_compressor("powersgd:rank=2"), Comm(None, CommLedger()), net.named_parameters()
        )
        model.register_comm_hook(state, hook)
        x = torch.randn(8, 16)
        x[0, 0] = float("nan")
        try:
            model(x).sum().backward()
            results["nan"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads the hook's error, however DDP wraps it
            results["nan"] = str(exc)
        state.close()
        torch.save(results, os.path.join(out_dir, f"ddp{rank}.pt"))
        del model  # before the group: harness.world.leave_group
        leave_group()
    except Exception:
        with open(os.path.join(out_dir, f"err{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _run(worker, tmp_path, timeout=90):
    ctx = mp.start_processes(worker, args=(_port(), str(tmp_path)), nprocs=2, join=False, start_method=forkserver())
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while not ctx.join(timeout=1):
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"{worker.__name__} did not finish in {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    errs = [f.read_text() for f in tmp_path.glob("err*.txt")]
    assert not errs, errs


@pytest.mark.slow
def test_compress_and_average_two_ranks(tmp_path):
    _run(_avg_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"avg{r}.pt") for r in (0, 1))
    for spec in AVG_SPECS:
        for step in range(3):
            for r in (r0, r1):  # written into given tensors (the DDP hook: into the bucket itself): same bits
                assert r[(spec, step, "out")] == (True, True), (spec, step, r[(spec, step, "out")])
            out0, sent0, analytic, recv0 = r0[(spec, step)]
            out1, sent1, _, _ = r1[(spec, step)]
            assert sent0 == sent1 == analytic, (spec, step, sent0, analytic)
            for n in out0:
                assert torch.equal(out0[n], out1[n]), (spec, n)  # identical bits on every rank
                assert out0[n].dtype == _inputs(0, step)[n].dtype and out0[n].shape == _inputs(0, step)[n].shape
            if spec == "none":
                for n, a in _inputs(0, step).items():
                    b = _inputs(1, step)[n]
                    expect = ((a.float() + b.float()) / 2).to(a.dtype)
                    assert torch.equal(out0[n], expect), n
            if spec == "powersgd:rank=2,start=1" and step == 0:  # the uncompressed start equals plain averaging
                for n in out0:
                    assert torch.equal(out0[n], r0[("none", 0)][0][n]), n
            if spec in ("fp16", "bf16", "int8"):
                a, b = _inputs(0, step)["w"], _inputs(1, step)["w"]
                rel = float((out0["w"] - (a + b) / 2).norm() / ((a + b) / 2).norm())
                assert rel < {"fp16": 1e-3, "bf16": 1e-2, "int8": 0.1}[spec], (spec, rel)
        if spec == "powersgd:rank=2":  # step 0 by hand: P = sum M_i Q, P^ = qr(P), mean = P^ (sum M_i^T P^)^T / 2
            a, b = _inputs(0, 0)["w"], _inputs(1, 0)["w"]
            q = PowerSGD(2).state("w", a)["Q"]
            p_hat = torch.linalg.qr(a @ q + b @ q).Q
            expect = p_hat @ (a.t() @ p_hat + b.t() @ p_hat).t() / 2
            assert torch.allclose(r0[(spec, 0)][0]["w"], expect, atol=1e-5)
        if spec == "powersgd:rank=2,bits=8":  # step 0 by hand: each rank's int8 codes decoded with its own scales
            c = PowerSGD(2, bits=8)
            a, b = _inputs(0, 0)["w"], _inputs(1, 0)["w"]
            q = c.state("w", a)["Q"]

            def dec(parts):
                return parts[0].float() * parts[1]

            p_hat = torch.linalg.qr(dec(c._encode(a @ q)) + dec(c._encode(b @ q))).Q
            expect = p_hat @ (dec(c._encode(a.t() @ p_hat)) + dec(c._encode(b.t() @ p_hat))).t() / 2
            assert torch.allclose(r0[(spec, 0)][0]["w"], expect, atol=1e-5)
            ref = r0[("powersgd:rank=2", 0)][0]["w"]
            assert float((r0[(spec, 0)][0]["w"] - ref).norm() / ref.norm()) < 0.03  # close to the fp32 factors
        if spec == "sign":  # step 0 has no residual yet: the vote of the raw inputs
            c = MajorityVote()
            hand = {n: c.combine_gathered([c.compress(_inputs(r, 0)[n], {}) for r in (0, 1)]) for n in ("w", "b")}
            for n in hand:
                assert torch.equal(r0[(spec, 0)][0][n], hand[n].to(r0[(spec, 0)][0][n].dtype))
    assert torch.equal(r0[("powersgd:rank=2", "Q")], r1[("powersgd:rank=2", "Q")])  # warm start in sync


@pytest.mark.slow
def test_ddp_hook_several_buckets_two_ranks(tmp_path):
    _run(_ddp_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"ddp{r}.pt") for r in (0, 1))
    for spec in DDP_SPECS:
        steps0, nbuckets, sd0 = r0[spec]
        steps1, _, sd1 = r1[spec]
        assert nbuckets >= 2, (spec, nbuckets)
        for (g0, l0, sent0, analytic), (g1, l1, sent1, _) in zip(steps0, steps1):
            assert sent0 == sent1 == analytic, (spec, sent0, analytic)
            for a, b in zip(g0, g1):
                assert torch.equal(a, b), spec
            if spec == "none":
                for a, x, y in zip(g0, l0, l1):
                    assert torch.allclose(a, (x + y) / 2, atol=1e-7)
        if spec != "none":  # state keyed by parameter name, not bucket
            names = set(sd0["compressor"]["states"])
            assert names == {"a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"}, names
    # inside the hook (hook_overlap=False) the same exchange, bit for bit, only on the autograd thread
    for threaded, inline in zip(r0["powersgd:rank=2"][0], r0["powersgd:rank=2|inline"][0]):
        assert threaded[2] == inline[2]
        assert all(torch.equal(a, b) for a, b in zip(threaded[0], inline[0]))
    for r in (r0, r1):
        assert "NaN/Inf" in r["nan"] and "a.weight" in r["nan"], r["nan"]
