"""shard-group (SOTA-119): hybrid sharding (shard inside groups, replicate across them) against full sharding
over the world, and the sizer's choice of group for a few memory budgets.

Measured: 4 workers in 2 islands train the same model with sharding groups of 1 (replicate only), 2 (the
island: HSDP) and 4 (full sharding across both islands); per-rank state bytes (FSDP's layout), payload
bytes per kind from rank 0's ledger, and the step time on loopback. Cross-island bytes are computed for
ring collectives over consecutive ranks (islands.sync.cross_island_wire_bytes): on loopback
every link is equally fast, so the time column cannot show the link the gathers avoid.
Computed: the group the sizer picks for a 1.3 B-parameter model shape on 8-rank islands of 80 GB devices
and smaller budgets.
"""

from __future__ import annotations

import os

from islands.sync import Unit, choose_group, cross_island_wire_bytes, state_bytes_per_rank
from islands_bench.experiments.sharding_common import lm_config, median_step_seconds, model_units
from islands_bench.harness import BenchContext, experiment

GROUPS = (1, 2, 4)
KINDS = ("fsdp_all_gather", "fsdp_reduce_scatter", "fsdp_replicate_all_reduce")


def _sizer_rows() -> list[dict]:
    """A GPT-style shape of about 1.3 B parameters (d=2048, 24 blocks of 12 d^2, 50k vocabulary)."""
    d, blocks, vocab = 2048, 24, 50304
    units = [Unit(f"block{i}", ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d)), False) for i in range(blocks)]
    units.append(Unit("root", ((vocab, d),), True))
    params = sum(u.numel() for u in units)
    rows = []
    for budget_gb in (80, 40, 16, 8, 4):
        try:
            g = choose_group(units, 64, 8, int(budget_gb * 1e9))
            need = state_bytes_per_rank(units, g)["total"] / 1e9
        except ValueError:
            g, need = 0, float("nan")
        rows.append(
            {
                "params_b": params / 1e9,
                "budget_gb": budget_gb,
                "world": 64,
                "island": 8,
                "chosen_group": g,
                "state_gb_per_rank": need,
                "replicated_gb": state_bytes_per_rank(units, 1)["total"] / 1e9,
            }
        )
    return rows


@experiment(
    "shard-group",
    practices=("SOTA-119",),
    help="HSDP (shard in a group, replicate across) vs full sharding: state per rank, cross-island bytes, "
    "the sizer's choice per memory budget",
)
def shard_group(ctx: BenchContext) -> dict:
    d, layers, steps = (64, 2, 4) if ctx.smoke else (128, 3, 8) if ctx.quick else (256, 4, 30)
    rows = []
    for g in GROUPS:
        cfg = lm_config(d, layers, steps, 4, islands=2, inner="fsdp", wrap="block", shard_group=str(g))
        load = os.getloadavg()[0]
        rec = ctx.train(f"group{g}", **cfg)
        n_steps = rec["summary"]["steps"]
        sent = rec["comm"]["per_rank"][0]["sent"]
        units = model_units(cfg, "block")
        row = {
            "run": f"group{g}",
            "shard_group": g,
            "replicas": 4 // g,
            "state_mb_per_rank": state_bytes_per_rank(units, g)["total"] / 1e6,
            "cross_island_wire_mb_per_step": cross_island_wire_bytes(units, 4, 2, g, True) / 1e6,
            "s_per_step": median_step_seconds(rec),
            "final_val_loss": rec["summary"]["final_val_loss"],
            "load_avg": load,
            "interconnect": rec["interconnect_line"],
        }
        row.update({f"{k}_mb_per_step": sent.get(k, 0) / n_steps / 1e6 for k in KINDS})
        rows.append(row)
    sizer = _sizer_rows()
    by = {r["shard_group"]: r for r in rows}
    headline = [
        f"4 workers in 2 islands, byte LM d={d}, {layers} layers: state per rank {by[1]['state_mb_per_rank']:.2f} / "
        f"{by[2]['state_mb_per_rank']:.2f} / {by[4]['state_mb_per_rank']:.2f} MB at group 1 / 2 (HSDP, the island) / 4 "
        f"(full); cross-island ring wire {by[1]['cross_island_wire_mb_per_step']:.2f} / "
        f"{by[2]['cross_island_wire_mb_per_step']:.2f} / {by[4]['cross_island_wire_mb_per_step']:.2f} MB per step "
        f"(HSDP {by[4]['cross_island_wire_mb_per_step'] / by[2]['cross_island_wire_mb_per_step']:.1f}x less than full "
        "sharding)",
        f"final val loss {by[1]['final_val_loss']:.4f} / {by[2]['final_val_loss']:.4f} / "
        f"{by[4]['final_val_loss']:.4f}; "
        f"loopback s/step {by[1]['s_per_step']:.3f} / {by[2]['s_per_step']:.3f} / {by[4]['s_per_step']:.3f} "
        f"(load {min(r['load_avg'] for r in rows):.0f}-{max(r['load_avg'] for r in rows):.0f}; loopback has no slow "
        "cross-island link, so this column does not test the claim)",
        "sizer, {:.2f} B parameters, 8-rank islands in a 64-rank world: ".format(sizer[0]["params_b"])
        + ", ".join(
            f"{r['budget_gb']} GB -> group {r['chosen_group'] or 'none'}"
            + (f" ({r['state_gb_per_rank']:.1f} GB/rank)" if r["chosen_group"] else "")
            for r in sizer
        )
        + f"; replicated state {sizer[0]['replicated_gb']:.1f} GB (fp32 parameters, gradients, two AdamW slots)",
    ]
    return {"rows": rows + sizer, "headline": headline}
