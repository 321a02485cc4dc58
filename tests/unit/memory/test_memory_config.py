"""Memory settings as config keys: clear errors for bad values, and the trainer using them end to end."""

import pytest

from islands.app.build import build_trainer
from islands.app.validate import validate
from islands.config import ConfigError, from_mapping, parse_flag_value
from islands.runtime.world import World

TINY = dict(
    d_model=32,
    n_layers=2,
    n_heads=2,
    context=16,
    global_batch=8,
    workers=1,
    steps=3,
    warmup=1,
    eval_every=0,
    eval_batches=1,
    probe=False,
    progress=False,
)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"precision": "fp16"}, "precision must be one of task .*fp32, bf16, auto; got 'fp16'"),
        ({"micro_batch": -1}, "micro_batch must be >= 0"),
        ({"micro_batch": 5, "global_batch": 8, "workers": 2}, r"micro_batch \(5\) exceeds the per-worker batch"),
        ({"memory_budget_mb": -1.0}, "memory.budget_mb must be >= 0"),
        ({"memory_budget_mb": 50.0, "micro_batch": 2}, "chooses micro_batch itself"),
        ({"activation_checkpointing": True, "task": "digits"}, "digits MLP holds too little"),
        ({"precision": "bf16", "inner": "fsdp", "workers": 2}, "not yet wired through inner.strategy=fsdp"),
        (
            {"micro_batch": 2, "inner": "pipeline", "workers": 2},
            "inner.strategy=pipeline",
        ),  # either check may speak first
    ],
)
def test_bad_memory_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(from_mapping(overrides))


def test_memory_keys_parse_from_flags_and_default_off():
    cfg = validate(from_mapping({}))
    assert (
        cfg.memory.activation_checkpointing,
        cfg.memory.precision,
        cfg.memory.micro_batch,
        cfg.memory.budget_mb,
    ) == (False, "task", 0, 0.0)
    assert parse_flag_value("memory_budget_mb", "12.5") == 12.5
    assert parse_flag_value("activation_checkpointing", "true") is True
    with pytest.raises(ConfigError, match="micro_batch must be int"):
        from_mapping({"micro_batch": "auto"})


def _train(**overrides):
    cfg = validate(from_mapping({**TINY, **overrides}))
    trainer = build_trainer(cfg, World.single())
    return trainer, trainer.fit(cfg.train.steps)


def test_trainer_accumulates_and_checkpoints_to_the_same_losses_as_the_plain_step():
    _, plain = _train()
    trainer, saver = _train(micro_batch=3, activation_checkpointing=True)
    assert trainer.model.checkpoint_segments == 2
    assert "memory" not in plain and saver["memory"]["micro_batch"] == 3
    a = [r["loss"] for r in plain["series"]["train"]]
    b = [r["loss"] for r in saver["series"]["train"]]
    assert a == pytest.approx(b, rel=1e-4)
    assert plain["summary"]["final_val_loss"] == pytest.approx(saver["summary"]["final_val_loss"], rel=1e-4)


def test_trainer_sizes_micro_batch_from_a_budget_and_records_the_plan():
    trainer, record = _train(memory_budget_mb=1.0, precision="bf16")
    plan = record["memory"]["plan"]
    assert 1 <= trainer.step_fn.micro_batch == plan["micro_batch"] <= 8
    assert plan["total_bytes"] <= 1_000_000
    assert record["memory"]["precision"] == "bf16"
    with pytest.raises(ConfigError, match="does not fit one sample"):  # before any worker starts
        validate(from_mapping({**TINY, "memory_budget_mb": 0.01}))
