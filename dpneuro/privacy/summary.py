"""privacy.json: what every site spent, computed from the ledgers."""

from __future__ import annotations

from typing import Any

from .cape_delta import max_colluding
from .ledger import PrivacyLedger


def privacy_report(
    ledgers: dict[str, PrivacyLedger], *, delta: float, n_subjects: dict[str, int], plan: str,
    n_colluding: int | None = None, seeded: bool = False, scaling_note: str | None = None,
) -> dict[str, Any]:
    """JSON-safe summary of every site's ledger, with the assumptions in plain words."""
    n_sites = len(ledgers)
    units = sorted({r.unit for led in ledgers.values() for r in led.releases}) or ["subject"]
    sites = {}
    for name, led in ledgers.items():
        s = led.summary(delta)
        s["n_subjects"] = int(n_subjects.get(name, 0))
        s["by_stage_mu"] = led.by_stage()
        s["ledger"] = led.to_dict()
        sites[name] = s
    S_C = max_colluding(n_sites) if n_colluding is None else n_colluding
    assumptions = []
    if plan == "cape":
        assumptions += [
            "Correlated noise (CAPE): each site's release alone carries the noise its own budget needs; "
            "the zero-sum parts cancel in the average, which carries the pooled-data noise level.",
            f"Sites and aggregator follow the protocol (honest but curious); at most {S_C} of the {n_sites} "
            f"sites collude with the aggregator (the most CAPE allows is ceil(S/3) - 1). The column "
            f"'vs aggregator + colluders' is the guarantee against that coalition.",
            "Zero-sum noise is summed by secure aggregation (X25519, ChaCha20 masks, Shamir shares): the "
            "aggregator learns only the sum of the sites' zero-sum draws.",
        ]
    elif plan == "conv":
        assumptions.append("Conventional decentralized DP: every site adds its full noise independently.")
    else:
        assumptions.append("NON-PRIVATE run (plan 'none'): the releases carry no noise.")
    assumptions += [
        "Totals compose every Gaussian release of every stage: exact Gaussian-DP composition (mu^2 = sum "
        "(sensitivity/sigma)^2), cross-checked with the RDP accountant of Google's dp-accounting.",
        "Numbers of subjects and time points per site, the data grid and the configuration are public.",
    ]
    if scaling_note:
        assumptions.append(scaling_note)
    assumptions.append(
        "Noise was drawn from fixed seeds (a reproducible simulation, not a deployment)." if seeded
        else "Noise was drawn from generators seeded from OS entropy.")
    return {"delta": delta, "unit": "/".join(units), "plan": plan, "n_sites": n_sites, "n_colluding": S_C,
            "sites": sites, "assumptions": assumptions}
