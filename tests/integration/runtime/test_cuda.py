"""CUDA and NCCL paths: compressors, the DDP hook, training, checkpoints (skipped without a GPU).

One GPU is enough. NCCL refuses two ranks on one device, so the collectives run in a world of one
NCCL rank: every payload still goes through NCCL on CUDA tensors, and the same calls over a gloo
group on CPU copies of the inputs are the reference. Run with `pytest tests/integration/runtime/test_cuda.py` on a GPU
machine (scripts/gpu-check does, with the GPU benchmarks).
"""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.procs import free_port
from islands.compress import Agreed, Combine, compress_and_average, ddp_comm_hook, parse_compressor
from islands.runtime.comm import Comm, CommLedger

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Same inputs give the same payload on both devices (up to float rounding of the kernels).
DETERMINISTIC = [
    "none",
    "fp16",
    "bf16",
    "topk:ratio=0.05,warmup=0",
    "powersgd:rank=2",
    "sign",
    "powersgd:rank=4,bits=16,dense_bits=16",
    "powersgd:rank=4,bits=8,dense_bits=16",
]  # bits=8: gathered sums
# Draw from the compressor's own per-device generator: equal in law, not in value, across devices.
STOCHASTIC = ["int8", "int4", "qsgd:levels=16", "randomk:ratio=0.25"]


@pytest.fixture(scope="module")
def groups():
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
        device_id=torch.device("cuda", 0),
    )
    gloo = dist.new_group(backend="gloo")
    yield {"cuda": None, "cpu": gloo}
    dist.destroy_process_group()


def _grads(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w1": (64, 48), "b1": (48,), "emb": (300, 16), "w2": (48, 10)}
    return {n: torch.randn(s, generator=g).to(device) for n, s in shapes.items()}


@pytest.mark.parametrize("spec", DETERMINISTIC)
def test_deterministic_compressors_agree_across_devices_over_nccl(groups, spec):
    out, sent = {}, {}
    for device in ("cpu", "cuda"):
        comp, ledger = parse_compressor(spec), CommLedger()
        comm = Comm(groups[device], ledger)
        rounds = [compress_and_average(_grads(device, seed), comm, comp) for seed in (0, 1)]  # state carries over
        out[device], sent[device] = rounds, ledger.total_sent
        assert all(t.device.type == device for r in rounds for t in r.values())
    assert sent["cuda"] == sent["cpu"]
    for cpu_round, cuda_round in zip(out["cpu"], out["cuda"]):
        for name, ref in cpu_round.items():
            assert cuda_round[name].shape == ref.shape and cuda_round[name].dtype == ref.dtype
            # int8 factors: kernels' rounding can move a code by one step (1/127 of a column's max)
            tol = 3e-2 if "bits=8" in spec else 2e-3
            torch.testing.assert_close(cuda_round[name].cpu(), ref, rtol=tol, atol=tol, msg=f"{spec} {name}")


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_stochastic_compressors_on_cuda_use_their_own_generator(groups, spec):
    comp, ledger = parse_compressor(spec), CommLedger()
    comm = Comm(groups["cuda"], ledger)
    global_cuda, global_cpu = torch.cuda.get_rng_state(), torch.get_rng_state()
    x = _grads("cuda")
    means = [compress_and_average(x, comm, comp) for _ in range(64)]
    assert torch.equal(torch.cuda.get_rng_state(), global_cuda) and torch.equal(torch.get_rng_state(), global_cpu)
    for name, t in x.items():
        avg = torch.stack([m[name] for m in means]).mean(0)
        assert avg.device.type == "cuda" and torch.isfinite(avg).all()
        # unbiased (or error-fed): the mean of many rounds approaches the input
        err = (avg - t).norm() / t.norm()
        assert err < 0.5, f"{spec} {name}: relative error of the 64-round mean {err:.3f}"
    assert any(not torch.equal(means[0][n], means[1][n]) for n in x)  # fresh draws each round


@pytest.mark.parametrize("spec", DETERMINISTIC + STOCHASTIC)
def test_payloads_pass_through_nccl_intact(groups, spec):
    """A world of one skips the collectives in Comm, so call NCCL on the payload tensors directly:
    it must accept their dtypes and layouts and return them unchanged."""
    comp = parse_compressor(spec)
    for name, g in _grads("cuda").items():
        st = comp.state(name, g)
        p = comp.compress(g, st, Agreed(comp.agree(g, st), 1))
        for t in p.tensors:
            assert t.device.type == "cuda"
            flat = t.reshape(-1).contiguous()
            if comp.combine is Combine.SUMMABLE:
                out = flat.clone()
                dist.all_reduce(out)
            else:
                out = torch.empty_like(flat)
                dist.all_gather_into_tensor(out, flat)
            assert torch.equal(out, flat), f"{spec} {name}: {t.dtype} payload changed in NCCL"


def test_ddp_hook_over_nccl_equals_the_standalone_average(groups):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    twin.load_state_dict(base.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(base, device_ids=[0], bucket_cap_mb=0.001)  # several buckets
    state, hook = ddp_comm_hook(parse_compressor("powersgd:rank=2"), Comm(None, CommLedger()), base.named_parameters())
    ddp.register_comm_hook(state, hook)
    standalone = parse_compressor("powersgd:rank=2")
    comm = Comm(None, CommLedger())
    for step in range(3):
        x = torch.randn(16, 32, device="cuda")
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        twin.zero_grad()
        twin(x).square().mean().backward()
        expected = compress_and_average({n: p.grad for n, p in twin.named_parameters()}, comm, standalone)
        for n, p in base.named_parameters():
            torch.testing.assert_close(p.grad, expected[n], rtol=1e-4, atol=1e-5, msg=f"step {step} {n}")


def _train(tmp_path: Path, *args: str) -> dict:
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "islands",
        "train",
        "--steps",
        "6",
        "--eval-every",
        "0",
        "--log-every",
        "2",
        "--d-model",
        "64",
        "--n-layers",
        "2",
        "--global-batch",
        "8",
        "--run-dir",
        str(run),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((run / "run.json").read_text())


@pytest.mark.parametrize(
    "args",
    [
        ("--workers", "1", "--device", "cuda"),
        ("--workers", "1", "--device", "cuda", "--inner", "fsdp"),
        ("--workers", "1", "--device", "cuda", "--precision", "bf16"),
    ],
)
def test_training_runs_on_cuda_with_nccl(tmp_path, args):
    rec = _train(tmp_path, *args)
    assert rec["world"]["device"].startswith("cuda") and rec["summary"]["steps"] == 6
    assert rec["world"]["backend"] in ("nccl", "none")  # one worker and no torchrun: no process group
    assert torch.isfinite(torch.tensor(rec["summary"]["final_val_loss"]))


def test_auto_device_falls_back_to_gloo_when_workers_outnumber_gpus(tmp_path):
    workers = torch.cuda.device_count() + 1
    rec = _train(tmp_path, "--workers", str(workers), "--global-batch", str(8 * workers))
    assert rec["world"]["backend"] == "gloo" and rec["world"]["device"] == "cpu"


def test_device_cuda_refuses_more_workers_than_gpus(tmp_path):
    workers = torch.cuda.device_count() + 1
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "islands",
            "train",
            "--device",
            "cuda",
            "--workers",
            str(workers),
            "--steps",
            "1",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "one GPU per local worker" in proc.stderr


def test_checkpoint_of_cuda_state_round_trips_sync_and_async(tmp_path):
    from islands.checkpoint import CheckpointStore
    from islands.checkpoint.store import AsyncCheckpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    saved_weight = model.weight.detach().cpu().clone()
    tree = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    store = CheckpointStore(tmp_path / "s")
    store.save(tree, 1)
    writer = AsyncCheckpointer(CheckpointStore(tmp_path / "a"))
    handle = writer.save(tree, 1)
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the snapshot must not see this
    handle.wait(60)
    assert handle.error is None
    writer.close(60)
    for root in ("s", "a"):
        loaded = CheckpointStore(tmp_path / root).load().tree
        assert torch.equal(loaded["model"]["weight"], saved_weight)
        assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"].cpu())
