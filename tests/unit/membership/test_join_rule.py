"""The elastic launcher's rule for restarted islands (islands.runtime.launch.elastic.join_rule): who lets one back
in is the outer strategy's side, read from the job's record (JobSpec.served). Synchronous strategies' members admit
it, so with none alive no island is restarted and the job has ended; a served job's (the parameter server's
processes) islands pull the model from the service, so they are restarted whoever is alive, and the job ends with
the service's final answer. The process test is tests/integration/outer/test_ps_elastic_all_restart.py."""

from __future__ import annotations

import json

from harness.dict_store import DictStore
from harness.elastic import elastic_config
from islands.app.launch import elastic_job
from islands.runtime.elastic.membership import JobSpec, Liveness
from islands.runtime.launch.elastic import MembersAdmit, ServiceAdmits, join_rule


def _epoch_0(*dead: str) -> tuple[DictStore, Liveness]:
    store = DictStore()
    store.set("e/0/members", json.dumps([[0, "w0", 0], [1, "w1", 1]]))
    for name in ("w0", "w1"):
        store.set(f"hb/{name}", "1")
    for name in dead:
        store.set(f"dead/{name}", "killed")
    return store, Liveness(store, 30.0)


def test_the_job_record_names_the_rule():
    assert isinstance(join_rule(JobSpec(workers=2)), MembersAdmit)
    assert isinstance(join_rule(JobSpec(workers=2, served=True)), ServiceAdmits)
    assert JobSpec.from_json(JobSpec(workers=2, served=True).to_json()).served
    old = json.loads(JobSpec(workers=2).to_json())
    del old["served"]  # a record written before the field: its members admit, as then
    assert JobSpec.from_json(json.dumps(old)).served is False


def test_members_admit_only_while_another_member_lives():
    rule = MembersAdmit()
    store, liveness = _epoch_0("w0")
    assert rule.restart_refusal(store, liveness, {"w0"}) is None and not rule.ended(store, liveness, finished=False)
    store, liveness = _epoch_0("w0", "w1")
    assert rule.restart_refusal(store, liveness, {"w0"}) == "no other island is alive to admit it"
    assert rule.ended(store, liveness, finished=False) and rule.members_admit


def test_a_served_job_restarts_with_no_member_alive_and_ends_with_its_final_answer():
    rule = ServiceAdmits()
    store, liveness = _epoch_0("w0", "w1")
    assert rule.restart_refusal(store, liveness, {"w0"}) is None
    assert not rule.ended(store, liveness, finished=False) and not rule.members_admit
    assert rule.ended(store, liveness, finished=True)  # an island had the final answer: the service is ending


def test_the_outer_strategy_decides_what_the_job_record_says(tmp_path):
    ps = elastic_config(workers=2, islands=2, outer="ps:inner_steps=4,servers=1", steps=8, global_batch=16)
    diloco = elastic_config(workers=2, islands=2, outer="diloco:inner_steps=4", steps=8, global_batch=16)
    assert elastic_job(ps, tmp_path).served and not elastic_job(diloco, tmp_path).served
