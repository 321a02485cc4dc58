"""Fault injection: Byzantine attack roles (attacks.py, roles.py) and, alongside, the network testbed."""

from islands.faults.attacks import ATTACK_KIND, AttackPlan, parse_attack, valid_attacks

__all__ = ["ATTACK_KIND", "AttackPlan", "parse_attack", "valid_attacks"]
