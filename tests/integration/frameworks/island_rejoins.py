"""A plain script (its own loop, DiLoCo attached to its optimizer) run as one island of a job of islands that are
separate jobs (ISLANDS_CROSS_*): test_frameworks.test_a_restarted_island_rejoins starts island 0 and island 1 as
processes of their own (or as torchrun jobs of 2 workers each, DDP inside), island 1 is SIGKILLed at step DIE_AT,
and the test starts it again with the same settings.

The loop runs from `world.start_step`: 0 for the islands of the first epoch, the members' step for a restarted
island (it enters at their round boundary with their global model and outer state). PACE_S: island 0 sleeps this
long after each step until it has admitted a joiner, so that on a loaded test machine it is still training when
the restarted process is up (it never waits for it: the pause is a step's length, not a wait on island 1).

STALL_AT, STALL_S: the first incarnation (TORCHELASTIC_RESTART_COUNT unset or 0: torchrun's count of its restarts)
sleeps STALL_S seconds before step STALL_AT, alive and beating, so that the others drop it at their next exchange
(test_frameworks.test_a_dropped_slow_island_is_restarted_and_rejoins).

TAMPER_AT: from this step on, this island's cross payloads are altered after they were tagged (one byte of each
flipped, as a box on the path between the islands would), so the other islands' checks refuse them
(test_frameworks.test_a_payload_that_fails_its_mac_ends_the_island_with_one_line)."""

import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from script_results import rejoin_result
from torch.nn.parallel import DistributedDataParallel

import islands

STEPS, DIE_AT = int(os.environ.get("STEPS", "200")), int(os.environ.get("DIE_AT", "-1"))
PACE_S = float(os.environ.get("PACE_S", "0"))
STALL_AT, STALL_S = int(os.environ.get("STALL_AT", "-1")), float(os.environ.get("STALL_S", "0"))
TAMPER_AT = int(os.environ.get("TAMPER_AT", "-1"))
FIRST_INCARNATION = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

world = islands.init_world()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
ddp = DistributedDataParallel(model) if world.local_size > 1 else model  # under torchrun: DDP inside the island
opt = torch.optim.SGD(model.parameters(), lr=0.01)
strategy = islands.outer.DiLoCo(inner_steps=10)
membership = world.membership
assert membership is not None  # a joined island's World holds the admission (islands.runtime.cross)


def tamper(tags) -> None:
    """Flip the first byte of everything `tags` packs from now on, leaving its tag as it was."""
    pack = tags.pack

    def altered(t, fields):
        packed = pack(t, fields)
        packed[0] ^= 0xFF
        return packed

    tags.pack = altered


g = torch.Generator().manual_seed(1000 + 10 * int(os.environ["ISLANDS_CROSS_INDEX"]) + world.local_rank)
steps = 0
with strategy.attach(model, opt, world):
    start = world.start_step  # where this incarnation entered
    print(f"STARTED {membership.name} at {start}", flush=True)
    for step in range(start, STEPS):
        if step == DIE_AT:
            os.kill(os.getpid(), signal.SIGKILL)  # the island's job is killed: no exit handler runs
        if step == STALL_AT and FIRST_INCARNATION:
            time.sleep(STALL_S)  # slow, not dead: the heartbeat thread beats on
        if step == TAMPER_AT:
            tamper(world.cross.comm.tags)
        x = torch.randn(16, 8, generator=g)
        F.mse_loss(ddp(x), x.sum(-1, keepdim=True)).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        if PACE_S and not any(e["type"] == "join" for e in membership.events):
            time.sleep(PACE_S)
rejoin_result(world, strategy, strategy.eval_model(model), start=start, steps=steps)
islands.close_world(world)
