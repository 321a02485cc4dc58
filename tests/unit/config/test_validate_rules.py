"""Validation reports every problem at once, and the rules about one component live in that component
(issue #33 item 5): validate asks the component, which raises the same message a library user gets."""

import types

import pytest
import torch

from islands.app.validate import problems, validate
from islands.checkpoint.policy.driver import CheckpointDriver
from islands.checkpoint.policy.settings import CheckpointSettings
from islands.cli import main
from islands.compress import TopKQ
from islands.config import ConfigError, from_mapping
from islands.sync.outer.gossip import Gossip

ELASTIC = dict(task="digits", workers=3, islands=3, elastic=True, global_batch=24)


def test_independent_mistakes_are_all_reported_in_one_run_with_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                "--run-dir",
                str(tmp_path / "r"),
                "--lr",
                "-1",
                "--data",
                "/nonexistent/corpus.txt",
                "--outer",
                "dilocoo:inner_steps=5",
                "--log",
                "tensorbord",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "4 problems in the config" in err
    lines = err.splitlines()
    for needle in ("train.lr must be > 0", "does not exist", "did you mean 'diloco'", "did you mean tensorboard"):
        assert sum(needle in line and line.startswith("- ") for line in lines) == 1, (needle, err)
    assert not (tmp_path / "r").exists()


def test_one_problem_reads_as_before():
    with pytest.raises(ConfigError) as e:
        validate(from_mapping(dict(lr=-1.0)))
    assert str(e.value) == "train.lr must be > 0; got -1.0"


def test_a_rule_reading_a_refused_value_is_skipped_not_repeated():
    # workers=0 fails `positive`; `shapes` (which divides by it) and every cross-section rule stay quiet
    found = problems(from_mapping(dict(workers=0)))
    assert found == ["world.workers must be >= 1; got 0"]


def test_compressed_gossip_in_an_elastic_job_is_refused_by_gossip_itself():
    gossip = Gossip(compressor=TopKQ())
    why = gossip.elastic_refusal()
    assert "compressed gossip is not supported in an elastic job" in why
    assert Gossip().elastic_refusal() is None
    # the library path: wrap on an elastic cross-island comm raises it before any collective
    world = types.SimpleNamespace(
        membership=None, distributed=True, comm=lambda name: types.SimpleNamespace(elastic=True, size=3)
    )
    with pytest.raises(ValueError) as raised:
        gossip.wrap(torch.nn.Linear(2, 2), None, world)
    assert str(raised.value) == why
    # the CLI path: validate asks the same strategy
    assert problems(from_mapping(dict(ELASTIC, outer="gossip:compressor=(topkq)"))) == [f"outer.strategy: {why}"]


@pytest.mark.parametrize(
    "settings,needle",
    [
        (CheckpointSettings(every=0, policy=None, memory_every=2, memory_peer=True), "leave memory_peer off"),
        (dict(ckpt_every=0, ckpt_policy="auto"), "fixed checkpoint interval"),
    ],
)
def test_what_elastic_checkpoints_cannot_do_is_the_drivers_rule(settings, needle):
    if isinstance(settings, dict):  # the same settings the config gives
        cfg = from_mapping(dict(ELASTIC, outer="diloco:inner_steps=5", **settings))
        from islands.app.build import checkpoint_settings

        settings, config = checkpoint_settings(cfg), cfg
    else:
        config = from_mapping(dict(ELASTIC, outer="diloco:inner_steps=5", ckpt_memory_every=2, ckpt_memory_peer=True))
    with pytest.raises(ValueError) as raised:
        CheckpointDriver.check_elastic(settings)
    assert needle in str(raised.value)
    elastic_world = types.SimpleNamespace(membership=object(), size=3, comms=None)
    with pytest.raises(ValueError) as built:
        CheckpointDriver(settings, elastic_world, run_dir="unused")
    assert str(built.value) == str(raised.value)
    assert problems(config) == [f"checkpoint: {raised.value}"]


def test_an_elastic_warm_start_asks_the_strategy_it_wraps():
    """validate asks the built outer strategy for its elastic rule; WarmStart answers with its DiLoCo's (it had no
    elastic_refusal, so validating any elastic job with warm_start raised AttributeError)."""
    ok = from_mapping(
        dict(
            task="digits",
            workers=2,
            islands=2,
            outer="diloco:inner_steps=5,warm_start=3",
            elastic=True,
            global_batch=16,
        )
    )
    assert validate(ok).elastic.enabled
    bad = from_mapping(
        dict(
            task="digits",
            workers=2,
            islands=2,
            elastic=True,
            global_batch=16,
            outer="diloco:inner_steps=5,warm_start=3,overlap=delayed",
        )
    )
    with pytest.raises(ConfigError, match="overlap=delayed is not supported in an elastic job"):
        validate(bad)


def test_an_elastic_ps_job_needs_server_processes_and_no_checkpoints_of_its_own_and_takes_ddp_islands():
    """ps runs in an elastic job with servers=S (its server as processes of their own, which outlive any island);
    the thread mode is refused by the strategy itself, naming servers=S, on the CLI path and the library path.
    Islands of several workers are taken with ddp or zero1 inside, not fsdp."""
    from islands.sync.outer.ps import parameter_server

    why = parameter_server(4).elastic_refusal()
    assert why is not None and "servers=S" in why and "thread of rank 0" in why
    assert parameter_server(4, servers=1).elastic_refusal() is None
    assert problems(from_mapping(dict(ELASTIC, outer="ps:inner_steps=4"))) == [f"outer.strategy: {why}"]
    world = types.SimpleNamespace(
        membership=None, distributed=True, comm=lambda name: types.SimpleNamespace(elastic=True, size=3)
    )
    with pytest.raises(ValueError) as raised:
        parameter_server(4).wrap(torch.nn.Linear(2, 2), None, world)
    assert str(raised.value) == why
    assert validate(from_mapping(dict(ELASTIC, outer="ps:inner_steps=4,servers=1"))).elastic.enabled
    (found,) = problems(from_mapping(dict(ELASTIC, outer="ps:inner_steps=4,servers=1", ckpt_every=4)))
    assert found.startswith("checkpoint: an elastic ps job keeps its state in the server processes' journals")
    # islands of several workers: ddp or zero1 inside (the leader speaks for its island); fsdp's shards are refused
    # as in a fixed job, naming what works
    for inner in ("auto", "ddp", "zero1"):
        several = dict(ELASTIC, workers=6, global_batch=24, inner=inner, outer="ps:inner_steps=4,servers=1")
        assert problems(from_mapping(several)) == [], inner
    several = dict(ELASTIC, workers=6, global_batch=24, inner="fsdp", outer="ps:inner_steps=4,servers=1")
    (found,) = problems(from_mapping(several))
    assert "inner.strategy=fsdp shards the parameters" in found and "'ps' is not wired for sharded" in found, found
    assert "use inner.strategy=ddp" in found, found


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(cross_backend="mpi"), ["world.cross_backend must be one of auto, gloo, nccl", "'mpi'"]),
        (dict(cross_backend="nccl", device="cpu"), ["cross_backend=nccl needs world.device=cuda"]),
        ({**ELASTIC, "cross_backend": "nccl", "outer": "diloco:inner_steps=2"}, ["elastic job exchanges over gloo"]),
        (dict(cross_backend="nccl", workers=2, islands=2, simulate=True), ["simulated islands"]),
        (
            {**ELASTIC, "workers": 4, "islands": 2, "device": "cuda", "outer": "diloco:inner_steps=2"},
            ["elastic job on GPUs", "islands of one worker; got 2 per island"],
        ),
    ],
)
def test_cross_backend_refusals(settings, words):
    found = problems(from_mapping(settings))
    assert any(all(w in m for w in words) for m in found), found


def test_gloo_across_is_a_valid_choice_anywhere():
    assert not [m for m in problems(from_mapping(dict(cross_backend="gloo"))) if "cross_backend" in m]


def test_the_worker_hands_its_cross_backend_and_testbed_to_init_world(monkeypatch, tmp_path):
    import islands.app.worker as worker

    seen = {}

    def fake_init_world(islands, timeout, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(worker, "init_world", fake_init_world)
    cfg = from_mapping(dict(cross_backend="gloo", testbed="tb"))
    with pytest.raises(RuntimeError, match="stop here"):
        worker.run_worker(cfg, tmp_path)
    assert seen["cross_backend"] == "gloo" and seen["gloo_links"] is True
