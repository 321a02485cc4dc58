"""Admission to an elastic job (islands.runtime.elastic): the object that is an elastic World's `membership`.

Joins happen only at a round boundary. The strategy the loop drives (a Stack, or an outer strategy used alone)
holds the membership: the first strategy whose wrap runs in an elastic world claims it (`claim`), calls `enter`
at the end of its wrap and `at_step` at the start of every step's hooks (after backward). At the first `at_step`
after the outer round counter moved, the members agree on which ready joiners enter, form the next epoch with
them (islands.runtime.elastic.epochs), and the joiners receive the lowest-ranked old member's {"model",
"strategy", "step"} (islands.runtime.elastic.transfer). A joiner's `enter` blocks until the members put it in an
epoch and loads what they sent, so its wrap returns with the global model, the strategy state and the step its
loop starts at. The hook sits after backward rather than at the end of the round's after_step so that the step's
own checkpoint (saved after after_step) is already taken: only saves still in flight have to finish first
(`before_join`).

Exchanges in flight across steps (DiLoCo tau > 0, streaming DiLoCo): a join first lets them finish (`settle` on
the outer part), so the new epoch never forms under an operation in flight, and the joiner receives their results
with the strategy state (DiLoCo's `inflight`): it lands them at the same steps as the members.

A ServedParticipant (contracts; the parameter server with servers of its own) has no round boundary the members
reach together and no state to serve: its joiner has pulled the global model from the service in its wrap, so
`enter` returns the step the participant names at once, without an epoch; `at_step` admits nobody; and at the
job's end `end_served` runs the service's own end first, then the members put the joiners that finished into one
last epoch (no transfer), which the end-of-run bookkeeping (the ledgers' gather) runs in.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch.distributed as dist

from islands.runtime.contracts import ElasticParticipant, ServedParticipant
from islands.runtime.elastic.comm import ElasticComm
from islands.runtime.elastic.epochs import Epochs
from islands.runtime.elastic.membership import (
    JOB_ENDED_EXIT_CODE,
    Admission,
    Heartbeat,
    JobSpec,
    Liveness,
    get_json,
    no_member_alive,
)
from islands.runtime.elastic.transfer import StateTransfer

# Seconds past the heartbeat timeout a joiner waits, with no member of the newest epoch alive, before it
# calls the job over: the last members' final writes land, and one false death alone does not end a wait.
ADMIT_LINGER_S = 2.0


class JobEnded(RuntimeError):
    """The job finished (its store went away) before admitting this joiner."""

    exit_code = JOB_ENDED_EXIT_CODE


class Membership:
    """`world.membership` of a member of an elastic job (contracts.ElasticMembership): its `epochs`, the
    collectives over them (`comm`, the World's cross-island Comm) and its state `transfer` at joins."""

    control_plane = None  # the job session, set by islands.runtime.world.join_elastic (run records)

    def __init__(self, epochs: Epochs, comm: ElasticComm, transfer: StateTransfer | None = None):
        self.epochs, self.comm, self.name, self.store = epochs, comm, epochs.name, epochs.store
        self.transfer = transfer if transfer is not None else StateTransfer(comm, lambda: self.participant)
        # another client of the same store, for a thread of its own (checkpoint persists: elastic_saves)
        self.new_client = epochs.new_client
        self._last_round: int | None = None
        # The strategy the loop drives: the first to claim() in its wrap; it shares and receives the state.
        self.holder = None
        # The outer strategy that counts the rounds joins wait for (participate(), from its wrap)
        self.participant: ElasticParticipant | None = None
        # Called before joiners enter: checkpoint drivers finish the saves in flight (a new epoch would abandon them).
        self.before_join: list[Callable[[], None]] = []
        # Set by islands.runtime.world.join_elastic: this process's heartbeat (stopped by leave), its admission
        # (slot, shard, initial) and the job it is in.
        self.heartbeat: Heartbeat | None = None
        self.admission: Admission | None = None
        self.job: JobSpec | None = None

    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    @property
    def names(self) -> list[str]:
        return self.epochs.names

    @property
    def events(self) -> list[dict]:
        """Membership changes, with timings (for reports): the epochs' failures, joins and entries."""
        return self.epochs.events

    @property
    def syncs(self) -> list[dict]:
        """Every committed operation of this member's collectives: epoch, seq, kind, start, seconds (run records)."""
        return self.comm.syncs

    @property
    def liveness(self) -> Liveness:
        return self.epochs.commit.liveness

    def authenticate(self, token: str, job_id: str | None = None) -> None:
        """Tag and check every payload of this member's operations from now on (ElasticComm.authenticate), under a
        key from `token` and the job's id (default: the job record's)."""
        self.comm.authenticate(token, job_id if job_id is not None else (self.job.job_id if self.job else ""))

    def new_liveness(self, client) -> Liveness:
        """A liveness check through `client` (one of new_client's), with this job's heartbeat timeout."""
        return Liveness(client, self.liveness.timeout)

    # ---- joins at round boundaries --------------------------------------------------------------
    def claim(self, strategy) -> bool:
        """Called first thing in a strategy's wrap: the first caller is the strategy the loop drives (a Stack
        claims before its outer part's wrap runs), which holds the membership; True for it alone."""
        if self.holder is None:
            self.holder = strategy
        return self.holder is strategy

    def participate(self, participant: ElasticParticipant) -> None:
        """Called by the outer strategy's wrap (inside a Stack or a WarmStart too): the part whose round counter
        joins wait for, whose exchanges in flight settle before a join and whose `joined` runs on a joiner."""
        self.participant = take_part(self.participant, participant)

    def enter(self, strategy, model) -> int:
        """Called at the end of the holding strategy's wrap; returns the step the loop starts at.

        A member of epoch 0 starts at 0. A joiner marks itself ready (its model and strategy exist, so the
        members never wait on its start-up), waits until the members put it in an epoch at a round boundary,
        then loads the global model and the strategy state they send and returns their step."""
        epochs, transfer = self.epochs, self.transfer
        if epochs.epoch >= 0:
            self._last_round = counted_rounds(self.participant)
            return 0
        if isinstance(self.participant, ServedParticipant):
            return self._enter_served(self.participant, strategy, model)
        self.store.set(f"ready/{self.name}", str(time.time()))
        try:
            raw = self._await_admission()
        except dist.DistNetworkError:
            raise JobEnded(
                "the job ended before admitting this worker: joiners enter at a round boundary and it "
                "had none left; nothing was trained here"
            ) from None
        if raw is None:
            raise JobEnded(
                "no member of the job's newest epoch has been alive for the heartbeat timeout, so nobody can "
                "admit this worker: the job is over; nothing was trained here"
            )
        entry = json.loads(raw)
        epochs.form(entry["epoch"], None)
        step = transfer.share_state(strategy, model, 0, set(entry["holders"]))
        self._last_round = counted_rounds(self.participant)
        epochs.events.append(
            {
                "type": "entered",
                "epoch": epochs.epoch + epochs.epoch_base,
                "step": step,
                "round": self._last_round,
                "time": time.time(),
                "global_sha256": transfer.global_sha(strategy, model),
                "transfer": transfer.transfers[-1] if transfer.transfers else {"via": "broadcast"},
            }
        )
        return step

    def _enter_served(self, participant: ServedParticipant, strategy, model) -> int:
        """A joiner of a served job: it already holds the service's global model (its wrap pulled it); it trains
        from the step the participant names, outside any epoch until the job's end (end_served)."""
        step = participant.entry_step()
        self._last_round = counted_rounds(participant)
        self.epochs.events.append(
            {
                "type": "entered",
                "via": "service",
                "epoch": None,
                "step": step,
                "round": self._last_round,
                "time": time.time(),
                "global_sha256": self.transfer.global_sha(strategy, model),
            }
        )
        return step

    def _await_admission(self) -> bytes | None:
        """The members' entry for this joiner (joinat/<name>), once they put it in an epoch. Only members
        admit, so the wait ends (None) when none of the newest epoch's has been alive for the heartbeat timeout
        plus ADMIT_LINGER_S: the job is over, or lost, or (a served job's end) up to its joiners. A closed store
        (the job host ended it) raises DistNetworkError. This is the joiner's own rule, not the launcher's nor
        the job host's: with both dead (chaos, session 14) a restarted island otherwise waited forever."""
        key, timeout = f"joinat/{self.name}", self.liveness.timeout
        look_s = min(0.25, timeout / 4)  # Liveness wants looks closer than half the timeout
        quiet_since, next_look = None, 0.0
        while not self.store.check([key]):
            now = time.monotonic()
            if now >= next_look:
                next_look = now + look_s
                if not no_member_alive(self.store, self.liveness):
                    quiet_since = None
                elif quiet_since is None:
                    quiet_since = now
                elif now - quiet_since > timeout + ADMIT_LINGER_S:
                    return None
            time.sleep(0.02)
        return self.store.get(key)

    def at_step(self, strategy, model, step: int) -> None:
        """Called by the holding strategy at the start of each step's hooks (after backward), `step` being the
        steps done: after a round boundary, admit the joiners that are ready. A served participant's rounds are each
        island's own: its joiners enter at the job's end (end_served), never here."""
        if isinstance(self.participant, ServedParticipant):
            return
        rounds = counted_rounds(self.participant)
        if self._last_round is None:  # enter() was not called: the first boundary is the end of the first round
            self._last_round = rounds
        if rounds == self._last_round:
            return
        self._last_round = rounds
        joiners = self._proposal(rounds)
        if joiners:
            self._admit(joiners, strategy, model, step, rounds)

    def _proposal(self, rounds: int) -> list[list]:
        """The joiners this round boundary admits: every member's verdict, the first proposal stored."""
        # only joiners that are ready (model built): the members must not wait on a joiner's start-up. A member
        # whose exchange of this round failed over proposes none: the failover and an admission in the same gap
        # between two steps add up (chaos, session 19: 1.64 + 0.53 s, the campaign's one stall over 2 s), so the
        # joiners wait for the next round. Joins happen only at a round's first step (the joiner runs that step
        # itself), and the first proposal stored is every member's verdict, so members that disagree (a
        # failover seen late on an exchange thread) still admit alike.
        epochs = self.epochs
        failed_over, epochs.failed_over = epochs.failed_over, False
        return self._agreed(f"round/{rounds}/join", [] if failed_over else self._ready())

    def _ready(self) -> list[list]:
        """Admitted joiners that are ready and not yet in an epoch."""
        return [
            p
            for p in get_json(self.store, "pending", [])
            if p[1] not in self.epochs.names
            and self.store.check([f"ready/{p[1]}"])
            and not self.store.check([f"joinat/{p[1]}"])
        ]

    def _agreed(self, key: str, mine: list[list]) -> list[list]:
        """The first proposal stored under `key`: every member's verdict."""
        self.store.compare_set(key, "", json.dumps(mine))
        return json.loads(self.store.get(key))

    def end_served(self, final: Callable[[], dict]) -> None:
        """The job's end for a ServedParticipant (contracts.ServedEnd). A joiner marks itself ready before `final`
        (the service answers every island's final only once each one still training is done, so when any member
        proposes, every joiner that trained until the end is ready), then waits for its epoch; the members agree
        on those joiners (store key end/join) and form the next epoch with them; no state travels: every island
        holds the service's final model. What `final` returns (the service's facts of this island's end) is
        recorded with a served_end event. With no member alive (every first island died; the joiners trained on
        with the service) the joiners form that epoch themselves (_enter_without_members). A joiner left out of
        the last epoch (it came after the others' end) ends with JobEnded."""
        epochs = self.epochs
        joining = epochs.epoch < 0
        if joining:
            self.store.set(f"ready/{self.name}", str(time.time()))
        facts = final()
        epochs.events.append({"type": "served_end", "time": time.time(), **facts})
        if joining:
            try:
                raw = self._await_admission()
                if raw is None:
                    self._enter_without_members()
                    return
            except dist.DistNetworkError:
                raise JobEnded("the job ended before this worker's island was put in its last epoch") from None
            epochs.form(json.loads(raw)["epoch"], None)
            epochs.events.append(
                {"type": "entered", "via": "end", "epoch": epochs.epoch + epochs.epoch_base, "time": time.time()}
            )
            return
        joiners = self._agreed("end/join", self._ready())
        if not joiners:
            return
        for settle in self.before_join:  # saves in flight finish in the epoch they started in
            settle()
        asked, _ = self._put_in(joiners)
        epochs.events.append(
            {
                "type": "join",
                "via": "end",
                "epoch": epochs.epoch + epochs.epoch_base,
                "joined": [j[1] for j in joiners],
                "size": epochs.size,
                "detected": asked,
                "resumed": time.time(),
                "stall_seconds": time.time() - asked,
            }
        )

    def _enter_without_members(self) -> None:
        """A served job's joiner at the end, with no member of the newest epoch alive: nobody is left to put it in,
        and it needs nobody (it holds the service's final model), so the joiners that finished form the last
        epoch among themselves. They agree under the members' key (end/join, first proposal wins), so an end the
        members made already is never made again: a joiner it left out ends with JobEnded, as before; the epoch's
        number is agreed too (end/epoch), since its rank 0 moves `latest` once it forms. Its rank 0 (the lowest
        slot) writes run.json, once."""
        epochs = self.epochs
        joiners = self._agreed("end/join", self._ready())
        if self.name not in [j[1] for j in joiners]:
            raise JobEnded("the job's last epoch formed without this worker (it finished after the others' end)")
        latest = int(self.store.get("latest")) if self.store.check(["latest"]) else 0
        self.store.compare_set("end/epoch", "", str(latest + 1))
        epochs.form(int(self.store.get("end/epoch")), sorted(joiners))
        epochs.events.append(
            {
                "type": "entered",
                "via": "end",
                "without_members": True,
                "epoch": epochs.epoch + epochs.epoch_base,
                "joined": list(epochs.names),
                "time": time.time(),
            }
        )

    def _put_in(self, joiners: list[list]) -> tuple[float, set[str]]:
        """Tell each joiner its epoch (joinat/<name>, with the members that hold the state) and form the next epoch
        with them; returns when they were told and those holders."""
        epochs = self.epochs
        nxt, holders = epochs.epoch + 1, set(epochs.names)
        for j in joiners:
            self.store.set(f"joinat/{j[1]}", json.dumps({"epoch": nxt, "holders": sorted(holders)}))
        asked = time.time()
        epochs.abort()
        epochs.form(nxt, sorted(epochs.members + joiners))
        return asked, holders

    def _admit(self, joiners: list[list], strategy, model, step: int, rounds: int) -> None:
        # exchanges still in flight (DiLoCo tau > 0, streaming) finish in the epoch they started in; their
        # results travel with the strategy state (a death meanwhile fails them over, the epoch moves on)
        assert self.participant is not None, "elastic needs an outer strategy (validate); it participates at wrap"
        self.participant.settle()
        for settle in self.before_join:
            # the step's checkpoint is already taken (the loop saves after after_step); one still persisting
            # must finish, or the new epoch would abandon it
            settle()
        epochs, transfer = self.epochs, self.transfer
        asked, holders = self._put_in(joiners)
        transfer.share_state(strategy, model, step, holders)
        epochs.events.append(
            {
                "type": "join",
                "global_sha256": transfer.global_sha(strategy, model),
                "epoch": epochs.epoch + epochs.epoch_base,
                "joined": [j[1] for j in joiners],
                "round": rounds,
                "step": step,
                "size": epochs.size,
                "detected": asked,
                "resumed": time.time(),
                "stall_seconds": time.time() - asked,
            }
        )

    # ---- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.epochs.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """A resumed job counts its epochs on from the saved one and keeps the saved history."""
        self.epochs.load_state_dict(state)

    def leave(self) -> None:
        """Stop the heartbeat, retire the group and tell the others this member finished."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.epochs.abort()
        try:
            self.store.set(f"dead/{self.name}", "finished")
        except dist.DistNetworkError:
            # the launcher's store is gone: the job ended while this worker finished (a joiner is not the
            # launcher's child and may end last); nobody is left to tell
            pass


def take_part(current: ElasticParticipant | None, participant: ElasticParticipant) -> ElasticParticipant:
    """The one participant of a membership: a second outer strategy wrapping in the same world is a mistake."""
    if current is not None and current is not participant:
        raise ValueError(
            f"two outer strategies take part in one elastic job ({type(current).__name__} and "
            f"{type(participant).__name__}); a job has one outer strategy"
        )
    return participant


def counted_rounds(participant: ElasticParticipant | None) -> int:
    """Rounds the outer strategy (the membership's participant) completed."""
    if participant is not None:
        return int(participant.rounds)
    raise TypeError(
        "an elastic job needs an outer strategy with a round counter (islands.outer.DiLoCo, LocalSGD, "
        "...); none took part in this one (an outer strategy's wrap hands it to world.membership)"
    )
