"""Compressed pushes across gloo processes (issue #36 item 1, ps_codecs.CompressedPushes): the server a thread of
rank 0, island 1 pushing topkq payloads of varying length over gloo point-to-point (GlooLink, GlooReceiver) on the
virtual clock's schedule ends on the global model of the same schedule under islands.simulate, bit for bit; its
pushes cost the payloads' bytes."""

from __future__ import annotations

import torch
from test_ps_dist import STEPS, H, simulate, train

from harness.outer import run_world
from islands.compress import TopKQ
from islands.sync.outer.ps_codecs import CompressedPushes

KW = dict(max_staleness=3, compressor=TopKQ(ratio=0.05, bits=2))


def compressed(world) -> dict:
    return train(world, **KW)


def test_compressed_pushes_over_gloo_end_on_the_simulated_model_bit_for_bit():
    ranks = run_world(compressed, size=2, islands=2)
    sim = simulate(dict(KW))
    for rank in (0, 1):
        assert ranks[rank]["counts"] == sim[rank]["counts"] and ranks[rank]["version"] == sim[rank]["version"]
        assert ranks[rank]["global"].tobytes() == sim[rank]["global"].tobytes(), f"island {rank}"
    assert ranks[0]["global"].tobytes() == ranks[1]["global"].tobytes()
    numel = ranks[0]["global"].size
    payload = 3 * 8 + CompressedPushes(KW["compressor"]).compressor.payload_nbytes((numel,), torch.float32)
    pushes = STEPS // H
    # island 1 over gloo: per push the header and its payload (topkq's bytes and 3 counts), then DONE's header
    assert ranks[1]["sent"] == pushes * (5 * 8 + payload) + 5 * 8
    assert ranks[1]["sent"] < pushes * numel  # under a quarter of fp32 pushes
