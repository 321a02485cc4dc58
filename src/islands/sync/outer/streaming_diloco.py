"""Streaming DiLoCo (SOTA-155, LIT-214): DiLoCo with a fragment schedule and 4-bit deltas.

Three changes to DiLoCo, each lowering the PEAK bytes of one synchronisation:
  * the flat parameter vector is split into F equal fragments; fragment p is synced every H steps
    at offset (p+1)*H/F, so one sync carries 1/F of the model and every element is sent exactly
    once per H-step cycle;
  * each fragment's exchange runs in the background while tau more inner steps happen; when it
    lands, the new global fragment is merged into the local one, local <- merge*local + (1-merge)*global
    (LIT-214), or with landing=replay local <- global + (local - local when the delta left): the new
    global plus exactly the tau steps taken since, so no work is counted twice or dropped;
  * the deltas travel as block-scaled 4-bit codes (quant4.py), but the outer step and the global
    model stay fp32; entropy=zstd adds a lossless zstd stage over the codes (zstd4.py), which is
    what takes the per-fragment cut past 8x (the fp32 block scales alone keep plain 4-bit under it).

It is DiLoCo with parts, nothing more:

    DiLoCo(inner_steps=H, schedule=Fragments(fragments=4, tau=1), exchange=Exchange(compressor=Quant4(1024)))

`StreamingDiLoCo` is that, kept for compatibility: the same constructor as DiLoCo, whose defaults (no schedule,
no exchange given) are Fragments(4, tau=1) and 4-bit deltas, and spec name "streaming-diloco"; its spec keys of
before (fragments, tau, merge, bits, block, entropy, landing, ...) build through StreamingDiLoCo.from_options
(options.streaming_parts). With fragments=1, tau=0, bits=32 it is exactly plain DiLoCo.
"""

from __future__ import annotations

from islands.sync.outer.diloco import DiLoCo
from islands.sync.outer.exchange import Exchange
from islands.sync.outer.options import streaming_codec, streaming_parts
from islands.sync.outer.rounds import Fragments, Schedule


class StreamingDiLoCo(DiLoCo):
    name = "streaming-diloco"
    parts = staticmethod(streaming_parts)

    def default_parts(self, schedule: Schedule | None, exchange: Exchange | None) -> tuple[Schedule, Exchange | None]:
        """The parts not given: Fragments(4, tau=1) and 4-bit deltas (Quant4, blocks of 1024)."""
        return (
            schedule if schedule is not None else Fragments(fragments=4, tau=1),
            exchange if exchange is not None else Exchange("outer_delta", compressor=streaming_codec()),
        )
