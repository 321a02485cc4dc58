"""The parameter server's step as delayed feedback, in the linear model (docs/parameter-server.md, "Where the time goes
under churn"): M equal-speed islands push in turn with quorum 1, so each push is M - 1 versions stale, and a push
moves the global model by a * delta where delta = c * (the model it pulled - the optimum) (c: the share of the way a
round of H inner steps goes in that direction). Per push: x[k+1] = x[k] - a * c * x[k - (M - 1)]. It is stable only
while a * c < 2 sin(pi / (2 (2 tau + 1))), tau = M - 1. Synchronous DiLoCo with lr sqrt(M) on the mean: per round
x' = (1 - sqrt(M) c) x. Prints, per M and step a: the limit, the contraction per round (all M islands pushed) and
the variance one island's round noise reaches in the model (the sum of the squared impulse response), against
DiLoCo's. No training; numpy only:

    python scripts/ps_delay_stability.py
"""

from __future__ import annotations

import math

import numpy as np


def contraction(a: float, tau: int) -> float:
    """Largest root modulus of z^(tau+1) - z^tau + a = 0: the decay per push."""
    poly = np.zeros(tau + 2)
    poly[0], poly[1] = 1.0, -1.0
    poly[-1] += a
    return float(max(abs(np.roots(poly))))


def noise_gain(a: float, tau: int, c: float, pushes: int = 6000) -> float:
    """Sum of the squared response of the model to one push's noise (injected times a); inf if it diverges."""
    x = np.zeros(pushes + tau + 1)
    x[tau] = 1.0
    for k in range(tau, pushes + tau):
        x[k + 1] = x[k] - a * c * x[k - tau]
        if abs(x[k + 1]) > 1e12:
            return math.inf
    return float((x**2).sum() * a * a)


def diloco_gain(m: int, c: float) -> float:
    """The same for synchronous DiLoCo: one island's noise enters as 1/sqrt(M) of it, the model decays by
    |1 - sqrt(M) c| per round."""
    rho = abs(1 - math.sqrt(m) * c)
    return (1 / m) / (1 - rho**2) if rho < 1 else math.inf


def main() -> None:
    for m in (2, 3, 4, 8):
        tau = m - 1
        limit = 2 * math.sin(math.pi / (2 * (2 * tau + 1)))
        rho = abs(1 - math.sqrt(m))  # DiLoCo at c = 1
        print(
            f"M={m}: staleness {tau}, stable while a*c < {limit:.3f}; DiLoCo contraction/round (c=1) {rho:.3f}, "
            f"noise gain c=1 {diloco_gain(m, 1.0):.3f}, c=0.5 {diloco_gain(m, 0.5):.3f}"
        )
        for name, a in (("1/sqrt(M) (default)", m**-0.5), ("discount=0.5: 1/M", 1 / m)):
            r = contraction(a, tau) ** m
            print(
                f"    a={a:.3f} {name}: {a / limit:.0%} of the limit, contraction/round (c=1) {r:.3f}, "
                f"noise gain c=1 {noise_gain(a, tau, 1.0):.3f}, c=0.5 {noise_gain(a, tau, 0.5):.3f}"
            )


if __name__ == "__main__":
    main()
