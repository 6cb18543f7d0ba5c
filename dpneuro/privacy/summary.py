"""privacy.json: what every site spent, computed from the ledgers, and how to say it in words."""

from __future__ import annotations

import math
from typing import Any

from dpneuro.privacy.cape_delta import max_colluding
from dpneuro.privacy.ledger import PrivacyLedger

#: headline eps above which a guarantee is called weak (and the run warns), and at or below which strong
WEAK_EPSILON = 10.0
STRONG_EPSILON = 1.0

NEIGHBOUR_TEXT = {
    "replace": "neighbouring datasets differ by replacing one subject's data (all time points of one person) "
               "with another's; the numbers of subjects and time points are public",
    "add-remove": "neighbouring datasets differ by adding or removing one unit (a papers' convention, "
                  "used only to reproduce them)",
}


def strength(epsilon: float) -> str:
    """'strong', 'moderate' or 'weak' (or 'none' for a non-private run)."""
    if math.isinf(epsilon):
        return "none"
    if epsilon <= STRONG_EPSILON:
        return "strong"
    return "moderate" if epsilon <= WEAK_EPSILON else "weak"


def plain_reading(epsilon: float, delta: float) -> str:
    """One sentence saying what eps means for a participant."""
    if math.isinf(epsilon):
        return "No privacy guarantee: the releases carry no noise."
    factor = math.exp(min(epsilon, 700.0))
    return (f"eps = {epsilon:.3g} means that whatever the aggregator and its colluders conclude, their odds "
            f"that a given person took part change by at most a factor e^eps = {factor:.3g} (except with "
            f"probability delta = {delta:g}).")


def privacy_report(
    ledgers: dict[str, PrivacyLedger], *, delta: float, n_subjects: dict[str, int], plan: str,
    n_colluding: int | None = None, seeded: bool = False, scaling_note: str | None = None,
) -> dict[str, Any]:
    """JSON-safe summary of every site's ledger, with the assumptions in plain words."""
    n_sites = len(ledgers)
    units = sorted({r.unit for led in ledgers.values() for r in led.releases}) or ["subject"]
    neighbours = sorted({r.neighbour for led in ledgers.values() for r in led.releases}) or ["replace"]
    sites = {}
    for name, led in ledgers.items():
        s = led.summary(delta)
        s["n_subjects"] = int(n_subjects.get(name, 0))
        s["by_stage_mu"] = led.by_stage()
        s["by_stage_mu_single_release"] = led.by_stage(collusion=False)
        s["ledger"] = led.to_dict()
        sites[name] = s
    S_C = (max_colluding(n_sites) if n_colluding is None else n_colluding) if plan == "cape" else 0
    assumptions = []
    if plan == "cape":
        assumptions += [
            "Correlated noise (CAPE): each site's release alone carries the noise its own budget needs; "
            "the zero-sum parts cancel in the average, which carries the pooled-data noise level.",
            f"Sites and aggregator follow the protocol (honest but curious); at most {S_C} of the {n_sites} "
            f"sites collude with the aggregator (the most CAPE allows is ceil(S/3) - 1). The headline eps is "
            f"the guarantee against that coalition: it sees every site's release and the zero-sum total.",
            "Zero-sum noise is summed by secure aggregation (X25519, ChaCha20 masks, Shamir shares): the "
            "aggregator learns only the sum of the sites' zero-sum draws.",
        ]
    elif plan == "conv":
        assumptions.append("Conventional decentralized DP: every site adds its full noise independently, so the "
                           "aggregator (with any colluders) learns no more about a site's subjects than that "
                           "site's own releases tell.")
    else:
        assumptions.append("NON-PRIVATE run (plan 'none'): the releases carry no noise.")
    assumptions += [
        "Totals compose every Gaussian release of every stage: exact Gaussian-DP composition (mu^2 = sum "
        "(sensitivity/sigma)^2), cross-checked with the RDP accountant of Google's dp-accounting.",
        "Numbers of subjects and time points per site, the data grid and the configuration are public.",
    ]
    not_private = sorted({led.not_private for led in ledgers.values() if led.not_private})
    assumptions += [f"NOT differentially private: {why}" for why in not_private]
    if scaling_note:
        assumptions.append(scaling_note)
    assumptions.append(
        "Noise was drawn from fixed seeds (a reproducible simulation, not a deployment)." if seeded
        else "Noise was drawn from generators seeded from OS entropy.")
    eps = {n: s["epsilon"] for n, s in sites.items()}
    worst = max(eps.values()) if eps else 0.0
    if plan == "cape" and math.isfinite(worst) and min(eps.values()) < worst * (1 - 1e-6):
        binding = ", ".join(n for n, e in eps.items() if e >= worst * (1 - 1e-6))
        assumptions.append(
            f"Sites differ in subjects or scan lengths. CAPE's plan gives every site at least the guarantee an "
            f"equal consortium gets at the same settings: {binding}, whose subjects move the average most "
            "(the longest scans), spends exactly that, the others less (docs/privacy.md, \"Unequal sites\").")
    return {"delta": delta, "unit": "/".join(units), "neighbour": "/".join(neighbours),
            "neighbour_text": "; ".join(NEIGHBOUR_TEXT[n] for n in neighbours),
            "plan": plan, "n_sites": n_sites, "n_colluding": S_C,
            "epsilon": eps,
            "threat_model": threat_model(plan, S_C),
            "strength": strength(worst), "reading": plain_reading(worst, delta),
            "sites": sites, "assumptions": assumptions, "not_private": not_private}


def threat_model(plan: str, n_colluding: int) -> str:
    """Whom the headline eps protects against, in one sentence."""
    if plan == "cape":
        return (f"the aggregator, which sees every site's release and the zero-sum total, colluding with up to "
                f"{n_colluding} site(s)")
    if plan == "conv":
        return "the aggregator and any coalition of other sites (every site's noise is independent)"
    return "nobody: the run was not private"


def headline_lines(priv: dict) -> list[str]:
    """The privacy lines at the top of a report and of the CLI summary (from privacy.json)."""
    delta = priv["delta"]
    eps = priv.get("epsilon") or {n: s["epsilon"] for n, s in priv["sites"].items()}
    lines = [f"Privacy per site (eps at delta = {delta:g}, every stage composed, against "
             f"{threat_model(priv['plan'], priv['n_colluding'])}): "
             + ", ".join(f"{n} {e:.2f}" for n, e in eps.items()) + "."]
    worst = max(eps.values()) if eps else 0.0
    label = strength(worst)
    if label != "none":
        lines.append(f"This guarantee is {label}. " + plain_reading(worst, delta))
    else:
        lines.append(plain_reading(worst, delta))
    return lines


def privacy_warnings(priv: dict) -> list[str]:
    """Warnings a user must see before trusting the run's privacy."""
    eps = priv.get("epsilon") or {n: s["epsilon"] for n, s in priv["sites"].items()}
    worst = max(eps.values()) if eps else 0.0
    out = []
    if math.isinf(worst):
        out.append("WARNING: this run is NOT private (some releases carry no noise).")
    elif worst > WEAK_EPSILON:
        out.append(f"WARNING: weak privacy: eps up to {worst:.3g} (above {WEAK_EPSILON:g}) at delta = "
                   f"{priv['delta']:g}; a review board may not accept it.")
    return out
