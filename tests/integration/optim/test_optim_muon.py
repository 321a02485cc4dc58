"""Muon inner steps (islands.optim.MuonAdamW, `--optimizer muon`) and MuLoCo (DiLoCo with Muon inside).

Checked: the split (hidden linear weights to Muon; embeddings, positional tables, the head, tied weights, biases
and norms to AdamW); Muon's half really is torch's Muon and the rest torch's AdamW, step for step; a tiny LM
learns; state_dict / load_state_dict, pickling and a Trainer checkpoint resume are bit for bit; under DDP on two
gloo ranks the ranks stay identical (and ZeRO-1 gives DDP's model bit for bit), and under DiLoCo with an
error-feedback int4 compressor across two islands (MuLoCo) the ranks agree on the global model and send the
compressed bytes; bad specs exit 2 naming the choices.
"""

from __future__ import annotations

import copy
import functools
import pickle

import numpy as np
import pytest
import torch
from test_checkpoint_resume import EXACT, TINY, same
from torch import nn

from harness.outer import run_world
from islands.app.build import build_trainer
from islands.app.validate import validate
from islands.checkpoint import CheckpointStore
from islands.cli import main
from islands.compress.optim import build_optimizer, parse_optimizer
from islands.config import ConfigError, from_mapping
from islands.models import MLP, ByteTransformer, sequence_loss
from islands.optim import MuonAdamW, muon_split
from islands.runtime.world import World


def names(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def lm(seed: int = 0) -> ByteTransformer:
    torch.manual_seed(seed)
    return ByteTransformer(d_model=32, n_layers=2, n_heads=2, context=16)


def lm_batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 8, (64,), generator=g)  # a short repeating "text": learnable in a few steps
    starts = torch.randint(0, 64 - 17, (n, 4), generator=g)
    return [torch.stack([text.roll(-int(s))[:17] for s in row]) for row in starts]


def train(model, opt, batches):
    losses = []
    for b in batches:
        loss = sequence_loss(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# ---- the split --------------------------------------------------------------------------------------
def test_split_gives_muon_the_hidden_matrices_and_adamw_the_rest():
    m = lm()
    muon, rest = muon_split(m)
    assert names(m, muon) == [f"blocks.{i}.{k}.weight" for i in range(2) for k in ("qkv", "proj", "fc", "out")]
    adamw = names(m, rest)
    for n in ("embed.weight", "pos", "head.weight", "ln.weight", "ln.bias", "blocks.0.qkv.bias", "blocks.1.ln2.weight"):
        assert n in adamw, n
    assert all(p.ndim == 2 for p in muon)
    assert len(muon) + len(rest) == len(list(m.parameters()))  # every parameter once
    # an MLP: the hidden layers to Muon, the classifier (the last linear module) to AdamW
    mlp = MLP(64, 32, 10)
    muon, rest = muon_split(mlp)
    assert names(mlp, muon) == ["net.0.weight", "net.2.weight"]
    assert names(mlp, rest) == ["net.0.bias", "net.2.bias", "net.4.weight", "net.4.bias"]
    # the head named explicitly, or none
    assert names(mlp, muon_split(mlp, head="net.0")[0]) == ["net.2.weight", "net.4.weight"]
    assert names(mlp, muon_split(mlp, head=())[0]) == ["net.0.weight", "net.2.weight", "net.4.weight"]
    with pytest.raises(ValueError, match="names no module"):
        muon_split(mlp, head="classifier")


def test_a_weight_tied_to_the_embedding_stays_with_adamw():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.hidden = nn.Linear(8, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight
            self.out = nn.Linear(16, 16)  # registered last, so it is taken as the head

    m = Tied()
    muon, rest = muon_split(m, head="out")
    assert names(m, muon) == ["hidden.weight"]
    assert "embed.weight" in names(m, rest)


# ---- the optimizer ----------------------------------------------------------------------------------
def test_each_half_steps_exactly_as_torchs_own_optimizer():
    a, b = lm(), lm()
    opt = MuonAdamW.for_model(a, lr=3e-3, weight_decay=0.1)
    muon_b, rest_b = muon_split(b)
    ref_muon = torch.optim.Muon(
        muon_b, lr=3e-3, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw"
    )
    ref_adamw = torch.optim.AdamW(rest_b, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for batch in lm_batches(3):
        for model, step in ((a, [opt]), (b, [ref_muon, ref_adamw])):
            sequence_loss(model(batch[:, :-1]), batch[:, 1:]).backward()
            for o in step:
                o.step()
                o.zero_grad()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert [g["kind"] for g in opt.param_groups] == ["muon", "adamw"]
    assert isinstance(opt, torch.optim.Optimizer)


def test_a_tiny_lm_learns():
    m = lm()
    losses = train(m, MuonAdamW.for_model(m, lr=3e-3), lm_batches(40))
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses


def test_state_dict_round_trip_and_pickle_resume_bitwise():
    batches = lm_batches(8)
    m = lm()
    opt = MuonAdamW.for_model(m, lr=3e-3)
    train(m, opt, batches[:4])
    saved = copy.deepcopy((m.state_dict(), opt.state_dict()))
    pickled = pickle.loads(pickle.dumps((m, opt)))
    train(m, opt, batches[4:])
    m2 = lm(seed=5)  # other weights, a fresh optimizer: everything comes from the saved state
    opt2 = MuonAdamW.for_model(m2, lr=3e-3)
    m2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    train(m2, opt2, batches[4:])
    m3, opt3 = pickled
    train(m3, opt3, batches[4:])
    for other, o in ((m2, opt2), (m3, opt3)):
        for (n, p), q in zip(m.named_parameters(), other.parameters()):
            assert torch.equal(p, q), n
        assert same(opt.state_dict(), o.state_dict())
    # a state of another optimizer (plain AdamW: one group) is refused, not half loaded
    with pytest.raises(ValueError):
        opt2.load_state_dict(torch.optim.AdamW(m2.parameters()).state_dict())


def test_bad_arguments_are_refused():
    m = lm()
    muon, rest = muon_split(m)
    with pytest.raises(ValueError, match="2-D weight matrices only"):
        MuonAdamW(muon + [rest[2]], rest[:2])
    with pytest.raises(ValueError, match="given twice"):
        MuonAdamW(muon, rest + muon[:1])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        MuonAdamW(muon, rest, adjust_lr_fn="spectral")
    with pytest.raises(ValueError, match="needs the model"):
        build_optimizer(parse_optimizer("muon"), m.parameters(), lr=1e-3)


# ---- through the config, the Trainer and the checkpointer -------------------------------------------
def test_trainer_checkpoint_resume_with_muon_is_bitwise(tmp_path):
    def trainer(name, **over):
        cfg = validate(from_mapping({**TINY, "workers": 1, "steps": 8, "optimizer": "muon", **over}))
        t = build_trainer(cfg, World.single(), tmp_path / name)
        return t, cfg

    a, _ = trainer("a", ckpt_every=4, ckpt_dir=str(tmp_path / "ca"))
    assert isinstance(a.optimizer, MuonAdamW)
    rec_a = a.fit(8)
    b, cfg_b = trainer("b", ckpt_every=4, ckpt_dir=str(tmp_path / "cb"))
    from islands.app.build import resume_trainer

    info = resume_trainer(b, from_mapping({"resume": str(tmp_path / "ca" / "step-000004")}, base=cfg_b))
    assert info["step"] == 4
    rec_b = b.fit(8)
    ta = CheckpointStore(tmp_path / "ca", clean=False).load(8).tree
    tb = CheckpointStore(tmp_path / "cb", clean=False).load(8).tree
    for key in EXACT:
        assert same(ta[key], tb[key]), key
    assert [g["kind"] for g in ta["optimizer"]["param_groups"]] == ["muon", "adamw"]
    assert any("momentum_buffer" in s for s in ta["optimizer"]["state"].values())  # Muon's state was saved
    assert rec_a["summary"]["final_val_loss"] == rec_b["summary"]["final_val_loss"]


def _train_job(overrides: dict, world):
    cfg = validate(from_mapping({**TINY, "steps": 6, "warmup": 1, "optimizer": "muon", **overrides}))
    trainer = build_trainer(cfg, world)
    record = trainer.fit(cfg.train.steps)
    outer = getattr(trainer.strategy, "outer", None)
    flat = (
        outer.global_flat
        if outer is not None
        else torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    )
    return {
        "params": flat.numpy().copy(),
        "sent": dict(world.ledger.snapshot()["sent"]),
        "exchanges": list(outer.exchange.sent) if outer is not None else [],
        "loss": record["summary"]["final_val_loss"],
        "kind": type(trainer.optimizer).__name__,
        "numel": flat.numel(),
    }


def _ddp_then_zero1(world):
    """Two jobs in one spawned world (one world start instead of two)."""
    return [_train_job({"workers": 2}, world), _train_job({"workers": 2, "inner": "zero1"}, world)]


@pytest.mark.slow  # two spawned 2-rank worlds, ~20-30 s on 2 shared cores
def test_muon_under_ddp_zero1_and_muloco_under_diloco_keep_ranks_identical():
    ddp, zero1 = (list(r) for r in zip(*run_world(_ddp_then_zero1, size=2, islands=1)))
    assert {r["kind"] for r in ddp} == {"MuonAdamW"}
    assert ddp[0]["params"].tobytes() == ddp[1]["params"].tobytes(), "DDP ranks drifted apart under Muon"
    assert np.isfinite(ddp[0]["loss"])
    # ZeRO-1 partitions whole parameters, so each matrix is still orthogonalised whole: the same model as DDP
    assert zero1[0]["params"].tobytes() == zero1[1]["params"].tobytes() == ddp[0]["params"].tobytes()
    outer = "diloco:inner_steps=3,compressor=(int4:ef=true)"  # MuLoCo: Muon inside, EF-compressed deltas across
    muloco = run_world(functools.partial(_train_job, {"workers": 2, "islands": 2, "outer": outer}), size=2, islands=2)
    assert muloco[0]["params"].tobytes() == muloco[1]["params"].tobytes(), "islands disagree on the global model"
    n = muloco[0]["numel"]
    exchanges = muloco[0]["exchanges"]
    assert len(exchanges) == 2  # rounds after steps 3 and 6
    assert all(0 < b < 4 * n / 6 for b in exchanges)  # int4 codes: ~8x under fp32's 4 bytes per value (measured 7.99x)
    assert np.isfinite(muloco[0]["loss"])


# ---- the edge -----------------------------------------------------------------------------------------
def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "spec,needles",
    [
        ("muonn", ["muon", "adamw"]),  # a misspelt name: the valid optimizers are listed
        ("muon:adjust_lr=spectral", ["adjust_lr", "match_rms_adamw", "original"]),
        ("muon:momentm=0.9", ["momentm", "momentum"]),
        ("muon:momentum=1.5", ["momentum"]),
    ],
)
def test_bad_muon_specs_exit_2_naming_the_choices(spec, needles, capsys, tmp_path):
    code, err = run_cli(["train", "--run-dir", str(tmp_path / "r"), "--optimizer", spec], capsys)
    assert code == 2, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_muon_is_refused_under_fsdp_which_shards_its_matrices():
    with pytest.raises(ConfigError, match="optimizer='muon'"):
        validate(from_mapping({**TINY, "workers": 2, "inner": "fsdp", "optimizer": "muon"}))
