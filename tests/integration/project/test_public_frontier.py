"""The frontier outer pieces (#19) through the public API on models islands did not write: a BatchNorm CNN
trained with Muon inside and compressed, overlapped exchanges across, and a transformers model built from a
config with a compressed DiLoCo. What must hold whatever the model: every island reports the same global
model, parameters and buffers; BatchNorm statistics reach it; the compressed exchange sent fewer bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import islands
from harness.world import spawn_ranks


class BNMLPNet(nn.Module):
    """Conv + BatchNorm, then a hidden linear layer (a matrix Muon takes) and a head (AdamW keeps it)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.hidden = nn.Linear(4 * 4 * 4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1)
        return self.head(F.relu(self.hidden(h)))


def _plain(t):
    return t.detach().float().numpy().copy()


def _batches(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _bn_worker(rank, env, queue, compress, overlap):
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world = islands.init_world(islands=2)
    torch.manual_seed(0)
    model = BNMLPNet()
    initial = {k: _plain(v) for k, v in model.state_dict().items()}
    muon, rest = islands.optim.muon_split(model)
    assert [id(p) for p in muon] == [id(model.hidden.weight)]
    opt = islands.optim.MuonAdamW(muon, rest, lr=1e-2)
    # the synchronous arm codes positions with Elias-Fano (SOTA-905), the overlapped one with fixed-width indices
    compressor = (
        islands.compress.TopKQ(ratio=0.1, bits=2, index="elias-fano" if overlap == "none" else "fixed")
        if compress
        else None
    )
    strategy = islands.outer.DiLoCo.from_options(inner_steps=4, compressor=compressor, overlap=overlap)
    model = strategy.wrap(model, opt, world)
    for step, (x, y) in enumerate(_batches(10 + rank, 12)):  # each island its own data
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        strategy.after_step(model, opt, step)
    strategy.finish(model)
    g = strategy.eval_model(model)
    queue.put((rank, {k: _plain(v) for k, v in g.state_dict().items()}, initial, world.ledger.total_sent))
    islands.close_world(world)


@pytest.mark.parametrize("compress,overlap", [(True, "none"), (True, "delayed"), (False, "delayed")])
def test_a_batchnorm_cnn_with_muon_and_compressed_overlapped_diloco(compress, overlap):
    (_, g0, init, _), (_, g1, _, _) = spawn_ranks(_bn_worker, 2, compress, overlap)
    for k, v in g0.items():
        assert (g1[k] == v).all(), k  # one global model on every island, buffers included
    assert int(g0["bn.num_batches_tracked"]) == 12
    assert (g0["bn.running_mean"] != init["bn.running_mean"]).any()  # statistics of the data reached it
    assert (g0["hidden.weight"] != init["hidden.weight"]).any()  # Muon's matrix moved and was exchanged


def _hf_worker(rank, env, queue, compressor_name):
    transformers = pytest.importorskip("transformers")
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world = islands.init_world(islands=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    compressor = {"none": None, "topkq": islands.compress.TopKQ(ratio=0.05, bits=2), "dct": islands.compress.DCTTopK()}[
        compressor_name
    ]
    strategy = islands.outer.DiLoCo(3, exchange=islands.outer.Exchange(compressor=compressor))
    g = torch.Generator().manual_seed(rank)
    data = [{"input_ids": (ids := torch.randint(0, 64, (4, 16), generator=g)), "labels": ids} for _ in range(6)]
    model = strategy.wrap(model, opt, world)
    for step, batch in enumerate(data):
        model(**batch).loss.backward()  # the model's own loss, a ModelOutput
        opt.step()
        opt.zero_grad()
        strategy.after_step(model, opt, step)
    strategy.finish(model)
    state = {k: _plain(v) for k, v in strategy.eval_model(model).state_dict().items()}
    queue.put((rank, state, world.ledger.total_sent))
    islands.close_world(world)


def test_a_transformers_model_with_compressed_diloco_sends_less_and_agrees():
    pytest.importorskip("transformers")
    dense = spawn_ranks(_hf_worker, 2, "none")
    for name in ("topkq", "dct"):
        got = spawn_ranks(_hf_worker, 2, name)
        for k, v in got[0][1].items():
            assert (got[1][1][k] == v).all(), (name, k)
        assert got[0][2] < dense[0][2] / 4, name  # the compressed exchange is a fraction of the dense one


def _bn_outer_worker(rank, env, queue, which):
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    world = islands.init_world(islands=2)
    # a different starting model per rank, as a loop that seeds by rank (or not at all) builds: wrap replaces it
    # by island 0's, for gossip's edge estimates and for DiLoCo's one global model alike
    torch.manual_seed(rank)
    model = BNMLPNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if which == "gossip":
        strategy = islands.outer.Gossip(
            every=2, topology=islands.outer.Ring(), compressor=islands.compress.TopKQ(ratio=0.2, bits=8), gamma=0.3
        )
    else:
        strategy = islands.outer.DiLoCo(4, schedule=islands.outer.Adaptive("speed"))
    model = strategy.wrap(model, opt, world)
    start = {k: _plain(v) for k, v in model.state_dict().items()}
    for step, (x, y) in enumerate(_batches(30 + rank, 12)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        strategy.after_step(model, opt, step)
    strategy.finish(model)
    g = {k: _plain(v) for k, v in strategy.eval_model(model).state_dict().items()}
    payload = strategy.estimates.nbytes if which == "gossip" else 0
    queue.put(
        (
            rank,
            g,
            start,
            world.ledger.snapshot()["sent"].get("outer_params", 0),
            strategy.rounds,
            payload,
            _plain(model.bn.running_var),
        )
    )
    islands.close_world(world)


def test_compressed_gossip_on_a_batchnorm_cnn_through_the_public_api():
    (_, g0, s0, sent0, rounds, payload, _), (_, g1, s1, _, _, _, _) = spawn_ranks(_bn_outer_worker, 2, "gossip")
    assert all((s0[k] == s1[k]).all() for k in s0)  # one starting point, agreed at wrap
    assert int(g0["bn.num_batches_tracked"]) == 12  # gossip's eval model keeps the island's own statistics
    assert not (g0["bn.running_mean"] == g1["bn.running_mean"]).all()  # own data, own statistics
    assert rounds == 6 and sent0 == rounds * payload  # one compressed payload to the one ring peer per round
    assert all(np.isfinite(v).all() for v in g0.values())


def test_speed_adaptive_diloco_on_a_batchnorm_cnn_through_the_public_api():
    (_, g0, s0, _, _, _, live0), (_, g1, s1, _, _, _, live1) = spawn_ranks(_bn_outer_worker, 2, "adaptive")
    assert all((s0[k] == s1[k]).all() for k in s0)  # seeded by rank, started from island 0's model
    for k, v in g0.items():
        assert (g1[k] == v).all(), k  # one global model, buffers included
    assert (live0 == live1).all()  # the islands adopted the averaged statistics
    assert int(g0["bn.num_batches_tracked"]) == 12
