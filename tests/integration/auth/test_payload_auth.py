"""Authenticated tensor payloads between islands (islands.runtime.payload_auth): the same results as the plain
Comm where nothing is touched, and an altered, replayed, relabelled or foreign contribution refused by the rank
that receives it. Real gloo processes (tests/outer_mp.run_world); each test's rank function returns plain data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_simulate import train

from harness.flags import tiny
from harness.outer import run_world

TOKEN = "the-job-secret"


class Tamper:
    """Stands in the network path of rank `victim`: hands the wrapped Comm's gathers through `edit`."""

    def __init__(self, inner, edit, victim: int = 0):
        self.inner, self.edit, self.victim, self.calls = inner, edit, victim, 0

    def __getattr__(self, name):  # exchange, exchange_async, ...: the wrapped Comm's
        return getattr(self.inner, name)

    # the Comm contract (runtime.contracts.Collectives), stated: what the wrapped Comm says
    elastic, epoch = False, None
    size = property(lambda self: self.inner.size)
    rank = property(lambda self: self.inner.rank)
    ledger = property(lambda self: self.inner.ledger)

    def all_reduce(self, tensor, op=None, kind="all_reduce"):
        return self.inner.all_reduce(tensor, kind=kind) if op is None else self.inner.all_reduce(tensor, op, kind)

    def broadcast(self, tensor, src, kind="broadcast"):
        return self.inner.broadcast(tensor, src, kind=kind)

    def all_gather_object(self, obj):
        return self.inner.all_gather_object(obj)

    def all_gather(self, tensor, kind="all_gather"):
        parts = self.inner.all_gather(tensor, kind=kind)
        if kind == "payload_auth_nonce":
            return parts
        self.calls += 1
        if self.inner.rank == self.victim:
            parts = self.edit(self.calls, [p.clone() for p in parts])
        return parts


def _attempt(world, edit, token=TOKEN, calls=2) -> str:
    from islands.runtime.payload_auth import AuthenticatedComm, PayloadAuthError

    comm = AuthenticatedComm(Tamper(world.comm("cross"), edit), token)
    refused = []
    for i in range(calls):  # every call is made on every rank, refused or not, so the collectives stay paired
        try:
            comm.all_reduce(torch.full((5,), float(world.rank + 1 + i)))
        except PayloadAuthError as e:
            refused.append(f"call {i + 1}: {e}")
    return f"refused: {refused[0]}" if refused else "accepted"


def _flip_a_byte(call, parts):
    parts[1][3] ^= 1
    return parts


_recorded: dict = {}


def _replay_call_one(call, parts):
    if call == 1:
        _recorded["one"] = parts[1].clone()
    else:
        parts[1] = _recorded["one"]  # rank 1's genuine call-1 payload, replayed into call 2
    return parts


def _swap_senders(call, parts):
    parts[1], parts[2] = parts[2], parts[1]
    return parts


def _rank_flip(world):
    return _attempt(world, _flip_a_byte)


def _rank_replay(world):
    return _attempt(world, _replay_call_one)


def _rank_swap(world):
    return _attempt(world, _swap_senders)


def _rank_wrong_token(world):
    return _attempt(world, lambda call, parts: parts, token=TOKEN if world.rank == 0 else "a-guess")


@pytest.mark.parametrize("fn, victims", [(_rank_flip, [0]), (_rank_replay, [0])])
def test_an_altered_or_replayed_contribution_is_refused_by_the_rank_that_receives_it(fn, victims):
    got = run_world(fn, size=2, islands=2)
    for rank, outcome in enumerate(got):
        if rank in victims:
            assert outcome.startswith("refused") and "from rank 1" in outcome, outcome
            assert ("call 2" in outcome) == (fn is _rank_replay), outcome  # a replay passes only its own call
        else:
            assert outcome == "accepted", outcome  # the honest path of the other rank is untouched


def test_contributions_relabelled_as_another_ranks_are_refused():
    got = run_world(_rank_swap, size=3, islands=3)
    assert got[0].startswith("refused") and got[1:] == ["accepted", "accepted"], got


def test_a_rank_without_the_token_is_refused_by_every_other():
    got = run_world(_rank_wrong_token, size=2, islands=2)
    assert all(o.startswith("refused") for o in got), got  # each side refuses the other's tags


def _collectives(world, authenticate: bool):
    from islands.runtime.payload_auth import AuthenticatedComm

    plain = world.comm("cross")
    comm = AuthenticatedComm(plain, TOKEN) if authenticate else plain
    r = world.rank
    out = {}
    x = torch.arange(6, dtype=torch.float32) * (r + 1)
    out["sum"] = comm.all_reduce(x.clone()).numpy()
    out["max"] = comm.all_reduce(x.clone(), op=dist.ReduceOp.MAX).numpy()
    out["gather"] = [t.numpy() for t in comm.all_gather(torch.tensor([r, 10 * r], dtype=torch.int64))]
    out["cat"] = comm.all_gather_cat(torch.full((2, 2), r, dtype=torch.bfloat16)).float().numpy()
    out["bcast"] = comm.broadcast(torch.full((3,), float(r)), src=1).numpy()
    fut = comm.all_reduce_async(torch.full((4,), 0.5 * (r + 1)))
    out["async"] = fut.wait().numpy()
    peer = (r + 1) % comm.size
    got = comm.exchange({peer: torch.full((3,), float(r))}, [(r - 1) % comm.size])
    out["p2p"] = next(iter(got.values())).numpy()
    out["product"] = comm.all_reduce(torch.tensor([r + 1.0, 2.0]), op=dist.ReduceOp.PRODUCT).numpy()
    out["bxor"] = comm.all_reduce(torch.tensor([r + 1, 6], dtype=torch.int64), op=dist.ReduceOp.BXOR).numpy()
    out["avg"] = comm.all_reduce(torch.full((2,), 3.0 * r), op=dist.ReduceOp.AVG).numpy()
    # reduce-scatter: dim 0 of 6 over 3 ranks, each keeps its 2 rows of the sum
    out["rs"] = comm.reduce_scatter(torch.arange(12, dtype=torch.float32).reshape(6, 2) * (r + 1)).numpy()
    # a lone send and receive around the ring, twice (each pair numbers its own messages)
    for k in range(2):
        if r == 0:
            comm.send(torch.full((2,), 10.0 * k + r), dst=1)
            out[f"recv{k}"] = comm.recv(torch.empty(2), src=comm.size - 1).numpy()
        else:
            out[f"recv{k}"] = comm.recv(torch.empty(2), src=r - 1).numpy()
            comm.send(torch.full((2,), 10.0 * k + r), dst=(r + 1) % comm.size)
    return out


def _plain(world):
    return _collectives(world, False)


def _auth(world):
    return _collectives(world, True)


def test_authenticated_collectives_give_the_plain_results():
    plain, auth = run_world(_plain, size=3, islands=3), run_world(_auth, size=3, islands=3)
    for p, a in zip(plain, auth):
        assert p.keys() == a.keys()
        for key in p:
            np.testing.assert_array_equal(np.asarray(p[key]), np.asarray(a[key]), err_msg=key)
    np.testing.assert_array_equal(auth[1]["rs"], (np.arange(12).reshape(6, 2) * 6)[2:4])
    np.testing.assert_array_equal(auth[0]["recv1"], [12.0, 12.0])  # rank 2's second message
    assert auth[0]["bxor"].tolist() == [1 ^ 2 ^ 3, 6 ^ 6 ^ 6]


def test_an_op_whose_factor_a_comparison_cannot_read_is_refused_with_the_ops_that_work():
    from islands.runtime.payload_auth import combine_in_order

    with pytest.raises(ValueError, match="SUM, AVG, PRODUCT, MAX, MIN, BAND, BOR or BXOR"):
        combine_in_order([torch.ones(2), torch.ones(2)], dist.ReduceOp.PREMUL_SUM)


class TamperSend:
    """In front of rank 1's receives: flips a bit of what arrives (a message altered on the way)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):  # exchange, exchange_async, ...: the wrapped Comm's
        return getattr(self.inner, name)

    # the Comm contract (runtime.contracts.Collectives), stated: what the wrapped Comm says
    elastic, epoch = False, None
    size = property(lambda self: self.inner.size)
    rank = property(lambda self: self.inner.rank)
    ledger = property(lambda self: self.inner.ledger)

    def all_reduce(self, tensor, op=None, kind="all_reduce"):
        return self.inner.all_reduce(tensor, kind=kind) if op is None else self.inner.all_reduce(tensor, op, kind)

    def broadcast(self, tensor, src, kind="broadcast"):
        return self.inner.broadcast(tensor, src, kind=kind)

    def all_gather_object(self, obj):
        return self.inner.all_gather_object(obj)

    def recv(self, tensor, src, kind="p2p"):
        got = self.inner.recv(tensor, src, kind=kind)
        got[0] ^= 1
        return got


def _tampered_send(world):
    from islands.runtime.payload_auth import AuthenticatedComm, PayloadAuthError

    inner = world.comm("cross")
    comm = AuthenticatedComm(TamperSend(inner) if world.rank == 1 else inner, TOKEN)
    if world.rank == 0:
        comm.send(torch.ones(3), dst=1)
        return "sent"
    try:
        comm.recv(torch.empty(3), src=0)
    except PayloadAuthError as e:
        return f"refused: {e}"
    return "accepted"


def test_a_lone_message_altered_on_the_way_is_refused():
    got = run_world(_tampered_send, size=2, islands=2)
    assert got[0] == "sent" and got[1].startswith("refused") and "from rank 0" in got[1], got


def _train_auth(spec):
    def run(world):
        from islands.runtime.payload_auth import authenticate_payloads

        authenticate_payloads(world, TOKEN)
        return train(world, spec)

    return run


def _diloco_plain(world):
    return train(world, "diloco:inner_steps=3")


def _diloco_auth(world):
    return _train_auth("diloco:inner_steps=3")(world)


def _eager_plain(world):
    return train(world, "diloco:inner_steps=3,overlap=eager")


def _eager_auth(world):
    return _train_auth("diloco:inner_steps=3,overlap=eager")(world)


def _gossip_plain(world):
    return train(world, "gossip:every=2")


def _gossip_auth(world):
    return _train_auth("gossip:every=2")(world)


@pytest.mark.parametrize(
    "plain, auth",
    [(_diloco_plain, _diloco_auth), (_eager_plain, _eager_auth), (_gossip_plain, _gossip_auth)],
    ids=["diloco", "eager", "gossip"],
)
def test_training_with_authenticated_payloads_equals_plain_training_bit_for_bit(plain, auth):
    """Two islands: a sum of two contributions is the same in either order, so the models match exactly; the
    ledger counts each exchange's 32-byte tag on top (and the nonces traded at the start)."""
    p, a = run_world(plain, size=2, islands=2), run_world(auth, size=2, islands=2)
    for x, y in zip(p, a):
        np.testing.assert_array_equal(x["global"], y["global"])
        np.testing.assert_array_equal(x["local"], y["local"])
    assert p[0]["sent"], "nothing was exchanged"
    extra = {k: a[0]["sent"].get(k, 0) - v for k, v in p[0]["sent"].items()}
    assert all(e > 0 and e % 32 == 0 for e in extra.values()), extra  # tags: 32 bytes per contribution
    assert a[0]["sent"]["payload_auth_nonce"] == 16


# ---- through the CLI -------------------------------------------------------------------------------
def test_islands_train_authenticates_its_outer_exchanges(tmp_path):
    """`--outer.authenticate`: the launcher makes the workers' token, every exchange carries its tags, and the run
    ends as the unauthenticated one does (two islands: the same sums)."""
    import json

    from islands.cli import main

    job = [
        "train",
        "--workers",
        "2",
        "--islands",
        "2",
        "--outer",
        "diloco:inner_steps=4",
        "--steps",
        "8",
        *tiny(global_batch=8, no_progress=True, device="cpu", no_probe=True),
    ]
    runs = {}
    for name, extra in (("plain", []), ("auth", ["--outer.authenticate"])):
        with pytest.raises(SystemExit) as e:
            main([*job, *extra, "--run-dir", str(tmp_path / name)])
        assert e.value.code == 0
        runs[name] = json.loads((tmp_path / name / "run.json").read_text())
    plain, auth = runs["plain"], runs["auth"]
    assert auth["config"]["outer"]["authenticate"] is True
    assert auth["summary"]["final_val_loss"] == plain["summary"]["final_val_loss"]
    sent = auth["comm"]["per_rank"][0]["sent"]
    assert sent["payload_auth_nonce"] == 16
    assert not (tmp_path / "auth" / "token").exists()  # the secret is never written down


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--simulate"], "simulated islands"),
    ],
)
def test_authenticated_payloads_refuse_what_they_do_not_cover(tmp_path, capsys, extra, message):
    from islands.cli import main

    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                "--workers",
                "2",
                "--islands",
                "2",
                "--outer",
                "diloco:inner_steps=4",
                "--steps",
                "4",
                "--outer.authenticate",
                *extra,
                "--run-dir",
                str(tmp_path / "r"),
            ]
        )
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything is written


def test_authenticated_payloads_need_islands_to_exchange(tmp_path, capsys):
    from islands.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--workers", "2", "--outer.authenticate", "--run-dir", str(tmp_path / "r")])
    assert e.value.code == 2 and "world.islands >= 2" in capsys.readouterr().err


def _fsdp_diloco(world, authenticate: bool):
    """FSDP inside each island (2 workers), DiLoCo across per shard: each worker's shard exchange is tagged."""
    from test_fsdp_outer import _build, _global, _steps

    from islands.runtime.payload_auth import authenticate_payloads

    if authenticate:
        authenticate_payloads(world, TOKEN)
    model, opt, strategy = _build(world, "fsdp")
    _steps(model, opt, strategy, world, range(6))
    strategy.finish(model)
    return _global(strategy, model)


def _fsdp_both(world):
    return {"plain": _fsdp_diloco(world, False), "auth": _fsdp_diloco(world, True)}


def test_fsdp_islands_exchange_authenticated_shards_with_the_same_result():
    for got in run_world(_fsdp_both, size=4, islands=2):
        for key in got["plain"]:
            np.testing.assert_array_equal(got["plain"][key], got["auth"][key], err_msg=key)
