"""Know before you rent (issue 37): predicted step time, bytes and memory of every strategy for a model and its links.

    profile   one worker's step as the Trainer runs it, and an outer strategy's local work per round, measured once
              on the device and cached (forward, backward, optimizer, activations)
    job       the job's Trainer as the planner builds it (islands.app.build's optimizer, schedule and step)
    links     link specs and alpha-beta collective costs, from a rate and latency or fitted to a gloo probe
    costs     per-strategy predictions from those pieces and the ledger's byte formulas
    rank      ranking and the crossovers of step time against cross-island bandwidth
    report    the table and the plot
    held      bytes of tensors a training run actually holds (what memory predictions are checked against)
    api       islands.plan(...): the string edge (job config, link and strategy specs) -> a Plan
See docs/plan.md.
"""

from islands.plan.api import DEFAULT_STRATEGIES, Plan, PlanError, plan
from islands.plan.costs import Candidate, Memory, Prediction, Topology, predict
from islands.plan.held import held_bytes, held_peak, simulated_held_peak
from islands.plan.links import AlphaBeta, Link, LinkError, fit_alpha_beta, parse_link, probe_link
from islands.plan.profile import Profile, profile_step

__all__ = [
    "DEFAULT_STRATEGIES",
    "Plan",
    "PlanError",
    "plan",
    "Candidate",
    "Memory",
    "Prediction",
    "Topology",
    "predict",
    "AlphaBeta",
    "Link",
    "LinkError",
    "fit_alpha_beta",
    "parse_link",
    "probe_link",
    "held_bytes",
    "held_peak",
    "simulated_held_peak",
    "Profile",
    "profile_step",
]
