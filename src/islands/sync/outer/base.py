"""What every outer strategy shares: the cross-island Comm, the global model, flat views, the clock.

An outer strategy runs across islands, after the inner strategy (ddp inside each island) has
stepped. It keeps:
  self.comm          the ONE object all its cross-island traffic goes through (Comm interface:
                     all_reduce, all_gather, broadcast, size, rank); set in wrap() from
                     world.comm("cross"), and replaceable (e.g. by an elastic Comm) between steps
  self.global_flat   fp32 vector of the last synchronised global parameters
  self.global_model  a copy of the model holding them: what eval_model() returns
  self.local         FlatView over the live (local) parameters the inner optimizer updates
  self.clock         steps taken so far; self.synced_at: the clock at the last full synchronisation

Elastic jobs (world.membership set; islands.runtime.elastic): used alone, not inside a Stack, the outer
strategy holds the membership. Its wrap claims it first and ends with `enter` (a joiner blocks there
until admitted, receives the global model, this state and the step, and sets world.start_step); its
after_backward calls `at_step`, where the members admit joiners after a round boundary. Held or not (inside
a Stack or a WarmStart), its wrap hands the membership itself as the participant whose rounds joins wait
for (`participate`; islands.runtime.contracts.ElasticParticipant: rounds, settle, joined).

End of training: `finish(model)` synchronises once more unless the last step already did (a
shortened final round), so the reported global model contains every island's work. No strategy
needs the run's length up front.

Buffers (BatchNorm running statistics and counters), the policy: parameters go through the outer
step, buffers do not. At every full synchronisation the islands' floating-point buffers are averaged
(one more all-reduce, kind "outer_buffers", preceded inside an island of several workers by one over the
island, kind "island_buffers", so every worker of every island holds the same; islands then adopt the
average), and integer buffers
(num_batches_tracked) are copied from the island, which counts the same steps as every other; the
global model then holds both, so evaluating or exporting it sees statistics of the data every island
trained on. Gossip has no global average: there the global model takes the island's own buffers, averaged over
the island's workers when it has several (`buffer_policy = "own"`). `buffer_policy = "none"` leaves the global
model's buffers as they were at wrap: what every outer strategy did before this policy, kept only as the
own-model bench's negative control.
"""

from __future__ import annotations

import copy
import hashlib

import torch
import torch.distributed as dist

from islands.runtime.elastic.island_comm import IslandComm
from islands.runtime.world import LoneComm  # the cross-island Comm of a job with one island (re-exported)
from islands.sync.base import NoOp
from islands.sync.ddp import unwrap
from islands.sync.outer.flat import FlatView

# What inner fsdp (sharded parameters) takes across islands: plain DiLoCo rounds, each worker exchanging its shard
SHARDED_OUTER = (
    "diloco:inner_steps=H, with any of outer, outer_lr, momentum, weight, lr_scale, outer_schedule, compressor"
)
BUFFER_KIND = "outer_buffers"
INIT_KIND = "outer_init"  # the one exchange of island 0's start (agree_start)
ISLAND_BUFFER_KIND = "island_buffers"  # inside an island of several workers, before the cross average
# a strategy's `statistics` option: its buffers averaged over the islands (mean), or each island's kept (own: islands
# whose inputs differ, where a mean of their BatchNorm statistics fits none of them)
STATISTICS = ("mean", "own")


class OuterStrategy(NoOp):
    name = "outer"
    buffer_policy = "average"  # average | own (gossip: no global average to take) | none (negative control)

    def __init__(self):
        self.comm = None
        self.membership = None  # the elastic membership, when this strategy holds it (wrap)
        self.rounds = 0  # completed synchronisations
        self.clock = 0  # steps seen (after_step calls)
        self.synced_at = 0  # the clock at the last full synchronisation
        self.island_comm = None  # the Comm over this worker's island when it has several workers (wrap)
        self.sharded = False  # the inner strategy shards the parameters (fsdp; wrap)
        self._round_buffers, self._round_seen, self._entry_buffers = None, None, None

    # ---- wiring -----------------------------------------------------------------------------------
    def wrap(self, model, optimizer, world):
        membership = world.membership
        # held: this strategy is the one the loop drives (not the outer part of a Stack, which claimed first)
        self.membership = membership if membership is not None and membership.claim(self) else None
        if membership is not None:  # held or not, its rounds are the ones joins wait for
            membership.participate(self)
        self.comm = world.comm("cross") if world.distributed else LoneComm()
        why = self.elastic_refusal() if self.comm.elastic else None
        if why:  # before any collective: every member refuses alike
            raise ValueError(why)
        self.island_comm = _island_comm(world)
        base = unwrap(model)
        self.sharded = is_sharded(base)
        why = self.sharded_refusal() if self.sharded else None
        if why:  # before any collective: every rank refuses alike
            raise ValueError(f"inner fsdp shards the parameters: {why}")
        if self.sharded and isinstance(self.comm, IslandComm):
            # an elastic island of k workers: its leader alone is a member, so the island's shards travel together
            # (island_comm.SlotComm); in a fixed world the "cross" group already pairs the workers of one shard
            self.comm = self.comm.per_slot()
        self.optimizer = optimizer
        self.local = FlatView(base.parameters())
        self.global_model = global_copy(base)
        self.global_view = FlatView(self.global_model.parameters())
        self.global_flat = self.local.read()
        self.local_buffers = list(base.buffers())
        self.global_buffers = list(self.global_model.buffers())
        self._round_buffers, self._round_seen, self._entry_buffers = None, None, None
        if membership is not None and self.local_buffers:
            # outside any torch.compile graph: traced, its check of self.rounds would recompile the model every round
            # until torch's limit of 8, after which the model runs eagerly (docs/own-model.md, "Compiled models")
            base.register_forward_pre_hook(torch.compiler.disable(self._note_round_start))
        # an elastic joiner receives its start in enter() (so do the followers of a joining k-worker island: their
        # epoch stays -1 until their leader enters); members of the first epoch agree here, followers through the relay
        joining = membership is not None and membership.epoch < 0
        if self.comm.size > 1 and not joining:
            self.agree_start(self.comm)
        self.setup()
        if self.membership is not None:
            world.start_step = self.membership.enter(self, model)
        return model

    @torch.no_grad()
    def agree_start(self, comm) -> None:
        """Every island starts from island 0's parameters and floating buffers, as DDP starts every rank from
        rank 0's. Without it a loop whose processes seed differently (or not at all) would give each island its
        own global model, offset from the others' for the whole run. Once per run, through any Comm: first an
        8-byte digest from each island (a loop that seeds alike sends nothing more), then, where they differ, a
        sum in which every island but 0 contributes zeros, which is exact."""
        floating = [b for b in self.local_buffers if b.is_floating_point()]
        n = self.global_flat.numel()
        flat = torch.cat([self.global_flat] + ([FlatView(floating).read()] if floating else []))
        digest = hashlib.sha256(flat.detach().cpu().numpy().tobytes()).digest()[:8]
        mine = torch.frombuffer(bytearray(digest), dtype=torch.int64).to(flat.device)
        if all(torch.equal(d, mine) for d in comm.all_gather(mine, kind=INIT_KIND)):
            return
        if comm.rank != 0:
            flat.zero_()
        comm.all_reduce(flat, kind=INIT_KIND)
        self.global_flat = flat[:n].clone()
        self.local.write(self.global_flat)
        self.publish()
        if floating:
            FlatView(floating).write(flat[n:])
        for own, glob in zip(self.local_buffers, self.global_buffers):
            glob.copy_(own)

    def sharded_refusal(self) -> str | None:
        """Why this strategy, as configured, cannot run on sharded parameters (inner fsdp: each worker holds and
        exchanges only its shard of every parameter); None when it can. Validation asks the same (app/validate)."""
        return (
            f"outer strategy {self.name!r} is not wired for sharded parameters yet; with inner fsdp use {SHARDED_OUTER}"
        )

    def elastic_refusal(self) -> str | None:
        """Why this strategy, as configured, cannot run in an elastic job (members come and go between rounds);
        None when it can. wrap raises it on an elastic comm; validation asks the same (app/validate)."""
        return None

    def setup(self) -> None:
        """Subclasses build their exchange and state here (self.local and self.global_flat exist; every island
        holds the same start)."""

    def eval_model(self, model):
        return self.global_model

    def after_backward(self, model, step):
        if self.membership is not None:  # elastic: joiners enter after a round boundary
            self.membership.at_step(self, model, step)

    # ---- elastic joins (islands.runtime.elastic) ----------------------------------------------------
    def settle(self) -> None:
        """Before a join: let the exchanges in flight finish (their results stay pending, to land at their step
        on every member, the joiner included, which receives them with the state). Nothing lands here."""
        self.in_order(lambda: None)

    def joined(self) -> None:
        """On a joiner, after it loaded the members' state: its own training starts from the global model (the
        holder's local work since the last synchronisation is the holder's to send, not the joiner's too), and
        from the holder's buffers as they were when the admitting step began (`_note_round_start`)."""
        self.adopt_global()
        if self._entry_buffers is not None:
            with torch.no_grad():
                for own, saved in zip(self.local_buffers, self._entry_buffers):
                    own.copy_(saved)
        self._entry_buffers = self._round_buffers = None

    def _note_round_start(self, module, args) -> None:
        """Elastic jobs: the buffers at the first training forward of each round. Members admit a joiner after
        that step's backward (at_step), when its forward has already moved running statistics and
        num_batches_tracked; the joiner then runs the same step itself, so it must start from the buffers the
        step began with, or it counts the step twice and ends a batch ahead of every other island."""
        if module.training and self._round_seen != self.rounds:
            self._round_seen = self.rounds
            self._round_buffers = [b.detach().clone() for b in self.local_buffers]

    # ---- the clock --------------------------------------------------------------------------------
    def tick(self, step: int) -> int:
        """Called first in after_step: the number of steps done."""
        self.clock = step + 1
        return self.clock

    def synced(self) -> None:
        """A full synchronisation just happened: the global model holds every island's work so far."""
        self.synced_buffers()
        self.synced_at = self.clock

    def finish(self, model) -> None:
        """The final synchronisation, unless the last step already was one."""
        if self.clock > self.synced_at or self.has_pending():
            self.final_sync()
            self.synced()

    def has_pending(self) -> bool:
        return False

    def final_sync(self) -> None:
        """Subclasses: one blocking synchronisation of everything (exchanges in flight landed first)."""
        raise TypeError(f"{type(self).__name__} defines no final_sync")

    # ---- helpers for subclasses -------------------------------------------------------------------
    def publish(self, lo: int = 0, hi: int | None = None) -> None:
        """Copy global_flat[lo:hi] into the global model (what evaluation sees)."""
        hi = self.global_flat.numel() if hi is None else hi
        self.global_view.write(self.global_flat[lo:hi], lo)

    def adopt_global(self, lo: int = 0, hi: int | None = None) -> None:
        """Local parameters restart from the global ones (the usual end of a round)."""
        hi = self.global_flat.numel() if hi is None else hi
        self.local.write(self.global_flat[lo:hi], lo)

    @torch.no_grad()
    def synced_buffers(self) -> None:
        """The buffer policy (module docstring): average floating buffers across islands, copy the rest."""
        if self.buffer_policy == "none":
            return
        floating = [b for b in self.local_buffers if b.is_floating_point()]
        island = self.island_comm
        across = self.buffer_policy == "average" and self.comm.size > 1
        if floating and (across or island is not None):
            # "own" (gossip) still averages inside a k-worker island: its workers are one replica, and each
            # one's running statistics saw only its own batches since DDP last broadcast them
            view = FlatView(floating)
            flat = view.read()
            if island is not None:
                # Workers of one island saw different batches, and DDP only re-sends rank 0's buffers at the next
                # forward: without this each worker's global model kept its own statistics (the cross exchange
                # pairs worker i of every island; an elastic island's relay takes only its leader's). On the
                # main thread, in step with the inner strategy's own collectives on this group.
                island.all_reduce(flat, kind=ISLAND_BUFFER_KIND)
                flat.div_(island.size)
            if across:
                self.in_order(lambda: self.comm.all_reduce(flat, kind=BUFFER_KIND))
                flat.div_(self.comm.size)
            view.write(flat)
        for own, glob in zip(self.local_buffers, self.global_buffers):
            glob.copy_(own)

    def in_order(self, fn):
        """Run a collective on self.comm after those the strategy has in flight (an overlapped exchange runs on a
        background thread: subclasses that have one route through it); at once by default."""
        return fn()

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # "local" carries this worker's live parameters (and buffers) mid-round: the trainer's "model" entry
        # is the global model (eval_model), so without them a resume would lose the round's local work.
        return {
            "global": self.global_flat.clone(),
            "local": self.local.read(),
            "rounds": self.rounds,
            "clock": self.clock,
            "synced_at": self.synced_at,
            "local_buffers": [b.detach().clone() for b in self.local_buffers],
            **self.extra_state(),
            # sharded: the global model's buffers live only here (its "model" entry, loaded through the inner
            # strategy's full copy, reaches the live model, not the ShardedGlobal), e.g. for an elastic joiner
            **({"global_buffers": [b.detach().clone() for b in self.global_buffers]} if self.sharded else {}),
            # for a joiner (joined): only while they are this round's
            **(
                {"round_buffers": self._round_buffers}
                if self._round_buffers is not None and self._round_seen == self.rounds
                else {}
            ),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        for key in ("global", "local"):
            if state[key].numel() != self.global_flat.numel():
                raise ValueError(
                    f"{self.name}: checkpoint {key!r} has {state[key].numel()} values, "
                    f"the model has {self.global_flat.numel()}; was it saved for another model?"
                )
        self.global_flat = state["global"].to(torch.float32).clone()
        self.publish()
        self.local.write(state["local"].to(torch.float32))
        self.rounds = int(state.get("rounds", 0))
        self.clock = int(state.get("clock", 0))
        self.synced_at = int(state.get("synced_at", self.clock))
        with torch.no_grad():
            for own, saved in zip(self.local_buffers, state.get("local_buffers", [])):
                own.copy_(saved)
            for glob, saved in zip(self.global_buffers, state.get("global_buffers", [])):
                glob.copy_(saved)
        self._entry_buffers, self._round_buffers = state.get("round_buffers"), None
        self.load_extra_state(state)

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass


def is_sharded(base: torch.nn.Module) -> bool:
    """True when the inner strategy shards the parameters (fsdp: they are DTensors)."""
    return any(hasattr(p, "to_local") for p in base.parameters())


def global_copy(base: torch.nn.Module) -> torch.nn.Module:
    """The module that holds the global model: a plain copy, or, when the inner strategy shards the parameters
    (FSDP2 refuses deepcopy), a ShardedGlobal of this rank's shards."""
    if is_sharded(base):
        return ShardedGlobal(base)
    return copy.deepcopy(base).requires_grad_(False)


class ShardedGlobal(torch.nn.Module):
    """The global model of a sharded island: for every parameter a DTensor laid out like the live one (same mesh,
    placements and global shape) over a copy of this rank's shard, and a copy of every buffer. The outer strategy
    updates only the shards (its flat vectors are per shard, flat.py), so it never holds more than 1/N of the
    model. It does not run forward: the inner strategy's eval_model (FSDP.eval_model) gathers it into a full
    module, so the Stack's eval_model (outer first, then inner) returns the full global model."""

    def __init__(self, base: torch.nn.Module):
        super().__init__()
        from torch.distributed.tensor import DTensor

        def shard_copy(p):
            if not hasattr(p, "to_local"):
                return p.detach().clone()
            return DTensor.from_local(
                p.to_local().detach().clone(),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )

        # kept outside nn.Module's registries (not Parameters: no autograd), listed under the live model's names
        self.named = [(name, shard_copy(p)) for name, p in base.named_parameters()]
        self.held_buffers = [b.detach().clone() for b in base.buffers()]
        self.train(base.training)

    def named_parameters(self, *args, **kwargs):
        return iter(self.named)

    def parameters(self, *args, **kwargs):
        return (p for _, p in self.named)

    def buffers(self, *args, **kwargs):
        return iter(self.held_buffers)

    def forward(self, *args, **kwargs):
        raise TypeError("the sharded global model holds shards only; evaluate the Stack's eval_model (gathered)")


def _island_comm(world):
    """The Comm over this worker's island when it has several workers (their buffers are averaged before the
    cross exchange: synced_buffers), else None. World test doubles without a "local" scope count as one."""
    try:
        local = world.comm("local") if world.distributed else None
    except (KeyError, AttributeError, TypeError):
        return None
    return local if local is not None and local.size > 1 else None


@torch.no_grad()
def average_buffers_at_the_end(comm, local_buffers: list[torch.Tensor], global_buffers: list[torch.Tensor]) -> None:
    """One model at the end, buffers included, for a strategy whose islands keep their own buffers through the run
    (the parameter server: it holds parameters only, so a BatchNorm model ended with one set of running statistics
    per island and the model the job kept was island 0's). In one collective of the job's end, when every island is
    done: floating buffers take their mean over the islands, as a DiLoCo round's do, integer ones
    (num_batches_tracked) the largest count; the global model takes them too."""
    if comm.size <= 1 or not local_buffers:
        return
    floating = [b for b in local_buffers if b.is_floating_point()]
    if floating:
        view = FlatView(floating)
        flat = view.read()
        comm.all_reduce(flat, kind=BUFFER_KIND)
        view.write(flat.div_(comm.size))
    counts = [b for b in local_buffers if not b.is_floating_point()]
    if counts:
        most = torch.cat([b.reshape(-1).to(torch.int64) for b in counts])
        comm.all_reduce(most, op=dist.ReduceOp.MAX, kind=BUFFER_KIND)
        for b, part in zip(counts, most.split([b.numel() for b in counts])):
            b.copy_(part.view(b.shape))
    for own, glob in zip(local_buffers, global_buffers):
        glob.copy_(own)
