"""Composition: islands=2, workers=4 is two DDP islands of two workers with DiLoCo across them.

Through the real Trainer: inside an island DDP keeps both workers identical every step (grad
all-reduce on the local group); across islands DiLoCo meets every H steps on the cross groups
({0, 2} and {1, 3}). Afterwards all four ranks hold bitwise the same global model, the island-mates
the same local model, and each rank's ledger shows exactly the analytic bytes of both levels.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness.outer import run_world

STEPS, H = 4, 2


def _train(world) -> dict:
    from islands.app.build import build_trainer
    from islands.app.validate import validate
    from islands.config import from_mapping

    cfg = validate(
        from_mapping(
            {
                "task": "lm",
                "d_model": 16,
                "n_layers": 1,
                "n_heads": 2,
                "context": 16,
                "global_batch": 8,
                "steps": STEPS,
                "warmup": 1,
                "workers": 4,
                "islands": 2,
                "outer": f"diloco:inner_steps={H}",
                "probe": False,
                "progress": False,
                "eval_every": 0,
                "eval_batches": 1,
                "log_every": 1,
            }
        )
    )
    trainer = build_trainer(cfg, world)
    record = trainer.fit(cfg.train.steps)
    outer = trainer.strategy.outer
    return {
        "global": outer.global_flat.numpy().copy(),
        "local": outer.local.read().numpy().copy(),
        "ledger": world.ledger.snapshot(),
        "name": trainer.strategy.name,
        "island": world.island,
        "numel": outer.global_flat.numel(),
        "summary": record["summary"],
    }


@pytest.mark.slow  # four processes on two cores: about 40 s
def test_two_ddp_islands_with_diloco_across():
    ranks = run_world(_train, size=4, islands=2)
    assert {r["name"] for r in ranks} == {"ddp+diloco"}
    assert [r["island"] for r in ranks] == [0, 0, 1, 1]
    g = ranks[0]["global"].tobytes()
    assert all(r["global"].tobytes() == g for r in ranks), "ranks disagree on the global model"
    assert ranks[0]["local"].tobytes() == ranks[1]["local"].tobytes()  # DDP inside island 0
    assert ranks[2]["local"].tobytes() == ranks[3]["local"].tobytes()  # DDP inside island 1
    payload = 4 * ranks[0]["numel"]
    for r in ranks:
        sent = {k: v for k, v in r["ledger"]["sent"].items() if v}
        # outer_init: the 8-byte digest of each island's start (alike here, so nothing more is sent)
        assert sent == {"grad_all_reduce": STEPS * payload, "outer_delta": (STEPS // H) * payload, "outer_init": 8}
        assert np.isfinite(r["summary"]["final_val_loss"])
