"""What the framework test scripts print (the RESULT line test_frameworks.py reads), written once for all of them.

The scripts run as programs of their own (`python island_rejoins_hf.py`), so this folder is on their path."""

import hashlib
import json
import sys

import torch.nn as nn


def digest(model: nn.Module) -> str:
    """A short fingerprint of the model's parameters: equal models, equal digests."""
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def print_result(line: dict) -> None:
    # one write for the whole line: under PYTHONUNBUFFERED print writes the text and its newline in two, and the
    # other island's rank 0 shares this stdout
    sys.stdout.write("RESULT " + json.dumps(line) + "\n")
    sys.stdout.flush()


def rejoin_result(world, strategy, model: nn.Module, **incarnation) -> None:
    """A rejoin script's RESULT: this incarnation's own fields (start, steps, ...), its membership's name and events,
    DiLoCo's rounds and exchange bytes (not the join's state transfer), and the global model's digest."""
    membership = world.membership
    assert membership is not None
    print_result(
        {
            "name": membership.name,
            **incarnation,
            "rounds": strategy.rounds,
            "islands": world.islands,
            "events": [{k: e[k] for k in ("type", "gone", "joined", "step") if k in e} for e in membership.events],
            "outer_sent": world.ledger.sent.get("outer_delta", 0),
            "ledger": dict(world.ledger.sent),
            "digest": digest(model),
        }
    )


def precision_result(world, strategy, model: nn.Module, optimizer_steps: int, round_digests: list) -> None:
    """A mixed-precision script's RESULT: the micro-batch losses and their count, the dtype autocast computed in, the
    dtypes of the parameters and of DiLoCo's global model, the exchange bytes, and the digests per round and at
    the end (after the final synchronisation)."""
    print_result(
        {
            "island": world.island,
            "losses": model.losses,
            "forwards": len(model.losses),
            "optimizer_steps": optimizer_steps,
            "computed_in": sorted(model.computed_in),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "global_dtypes": sorted({str(p.dtype) for p in strategy.global_model.parameters()}),
            "numel": sum(p.numel() for p in model.parameters()),
            "outer_bytes": world.ledger.sent.get("outer_delta", 0),
            "rounds": strategy.rounds,
            "round_digests": round_digests,
            "digest": digest(model),
        }
    )
