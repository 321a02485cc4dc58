"""Fault injection: Byzantine attack roles (attacks.py, roles.py), islands computing slower than the rest
(slowdown.py) and, alongside, the network testbed."""

from islands.faults.attacks import ATTACK_KIND, ATTACKS, AttackPlan, parse_attack, valid_attacks
from islands.faults.roles import flip_targets
from islands.faults.slowdown import SlowStep, parse_slowdown

__all__ = [
    "ATTACK_KIND",
    "AttackPlan",
    "parse_attack",
    "valid_attacks",
    "ATTACKS",  # the attack registry: spec string -> Byzantine, as islands.aggregate's AGGREGATORS
    "flip_targets",  # the labels a label-flip attacker trains on, for simulating one outside a job
    "SlowStep",
    "parse_slowdown",
]  # a slower host rehearsed on this one (world.slowdown)
