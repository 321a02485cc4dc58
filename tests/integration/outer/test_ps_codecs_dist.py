"""Compressed pushes and pulls across gloo processes (issue #36 item 1, ps_codecs.CompressedPushes, ps_pulls): the
server a thread of rank 0, island 1 pushing topkq payloads of varying length, or pulling int8 steps from the copy it
holds, over gloo point-to-point (GlooLink, GlooReceiver) on the virtual clock's schedule ends on the global model of
the same schedule under islands.simulate, bit for bit; its pushes and pulls cost the payloads' bytes."""

from __future__ import annotations

import pytest
import torch
from test_ps_dist import STEPS, H, simulate, train

from harness.outer import run_world
from islands.compress import COMPRESSORS, TopKQ
from islands.sync.outer.ps_codecs import CompressedPushes
from islands.sync.outer.ps_link import ANSWER_BYTES, HEADER_BYTES

RUNS = {
    "pushes": dict(max_staleness=3, compressor=TopKQ(ratio=0.05, bits=2)),
    "pulls": dict(max_staleness=3, pulls=COMPRESSORS.build("int8")),
}


def compressed(world) -> dict:
    return {name: train(world, **dict(kw)) for name, kw in RUNS.items()}


@pytest.fixture(scope="module")
def ranks():
    return run_world(compressed, size=2, islands=2)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_compressed_pushes_and_pulls_over_gloo_end_on_the_simulated_model_bit_for_bit(ranks, name):
    sim = simulate(dict(RUNS[name]))
    for rank in (0, 1):
        real = ranks[rank][name]
        assert real["counts"] == sim[rank]["counts"] and real["version"] == sim[rank]["version"]
        assert real["global"].tobytes() == sim[rank]["global"].tobytes(), f"island {rank}"
    assert ranks[0][name]["global"].tobytes() == ranks[1][name]["global"].tobytes()


def test_compressed_pushes_cost_their_payloads_bytes(ranks):
    numel = ranks[0]["pushes"]["global"].size
    payload = 3 * 8 + CompressedPushes(RUNS["pushes"]["compressor"]).compressor.payload_nbytes((numel,), torch.float32)
    pushes = STEPS // H
    # island 1 over gloo: per push the header and its payload (topkq's bytes and 3 counts), then DONE's header
    assert ranks[1]["pushes"]["sent"] == pushes * (HEADER_BYTES + payload) + HEADER_BYTES
    assert ranks[1]["pushes"]["sent"] < pushes * numel  # under a quarter of fp32 pushes


def test_compressed_pulls_cost_their_payloads_bytes_and_the_first_and_final_answers_the_model(ranks):
    numel = ranks[0]["pulls"]["global"].size
    pushes = STEPS // H
    # island 1 over gloo: its first push's answer and DONE's are the fp32 model; the other answers int8 steps: two
    # counts, the int8 codes and their one fp32 scale
    coded = 2 * 8 + numel + 4
    assert ranks[1]["pulls"]["pulled"] == (pushes + 1) * ANSWER_BYTES + 2 * 4 * numel + (pushes - 1) * coded
    assert coded < 4 * numel / 3  # a coded answer: about a quarter of the fp32 model
    assert ranks[1]["pushes"]["pulled"] == (pushes + 1) * (ANSWER_BYTES + 4 * numel)  # fp32 pulls: every answer
