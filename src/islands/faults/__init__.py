"""Fault injection: Byzantine attack roles (attacks.py, roles.py) and, alongside, the network testbed."""

from islands.faults.attacks import ATTACK_KIND, ATTACKS, AttackPlan, parse_attack, valid_attacks
from islands.faults.roles import flip_targets

__all__ = ["ATTACK_KIND", "AttackPlan", "parse_attack", "valid_attacks",
           "ATTACKS",  # the attack registry: spec string -> Byzantine, as islands.aggregate's AGGREGATORS
           "flip_targets"]  # the labels a label-flip attacker trains on, for simulating one outside a job
