"""Shared by the deployment tests: a tiny synthetic consortium and its in-process reference run."""

from __future__ import annotations

import json
import math
from pathlib import Path

from dpneuro.config import RunConfig
from dpneuro.datasets.synth import make_consortium
from dpneuro.privacy import PrivacyLedger
from dpneuro.run import pipeline, stages

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "site_templates"


def consortium(root: Path, *, n_timepoints: int = 40, seed: int = 0) -> dict:
    """4 sites x 3 subjects on the 30 x 30 grid, 4 sources."""
    return make_consortium(root, n_sites=4, subjects_per_site=3, n_components=4, n_timepoints=n_timepoints,
                           space="grid30", random_state=seed)


def run_config(man: dict, out: Path, **kw) -> RunConfig:
    """A run on the consortium ``man``; small and fast, seeded (tests compare runs).

    Temporal ICA unless ``ica`` is given: its private rounds are what most deployment tests follow.
    """
    d = dict(sites=[{"name": s["site"], "path": s["path"]} for s in man["sites"]], out=str(out), space="grid30",
             parcels=60, n_components=4, ica="temporal", pca_epsilon=20.0, ica_epsilon_i=4.0, ica_delta_i=0.01, ica_rounds=12,
             clip_G=5.0, clip_h=5.0, seed=3, simulation=True, plan="cape", timeout=60.0)
    d.update(kw)
    return RunConfig.from_dict(d).validate()


def reference(cfg: RunConfig) -> dict:
    """The simulation path (the Pydra workflow's stage functions): basis, W, b and each site's merged ledger."""
    work = Path(cfg.out) / "work"
    work.mkdir(parents=True, exist_ok=True)
    cj = work / "config.json"
    cj.write_text(json.dumps(cfg.to_json(), default=str))
    space = pipeline.stage_space(str(cj))
    sites = [pipeline.stage_load(str(cj), s.name, space) for s in cfg.sites]
    last = space
    for rel in stages.RELEASES:
        last = pipeline.stage_release(str(cj), sites, rel.name, last)
    chain = json.loads(Path(last).read_text())["chain"]
    public = pipeline.public_results(chain)
    ledgers = {}
    for s in cfg.sites:
        recs = [json.loads(Path(p).read_text()) for name, p in chain.items() if name != "space"]
        parts = [PrivacyLedger.from_dict(x["ledgers"][s.name]) for x in recs if s.name in x["ledgers"]]
        ledgers[s.name] = PrivacyLedger.merge_all(parts).to_dict()
    return {"basis": public["reduce"]["basis"], "eigenvalues": public["reduce"]["eigenvalues"],
            "W": public["unmix"]["W"], "b": public["unmix"]["b"], "rounds": public["unmix"]["rounds"],
            "ledgers": ledgers, "centroids": public.get("states", {}).get("centroids"),
            "fnc": public.get("fnc", {}).get("fnc"), "glm": public.get("glm")}


def same_releases(a: dict, b: dict, rtol: float = 0.0) -> bool:
    """Two ledgers (as dicts) recorded the same releases, counts and noise draws (owners may differ).

    ``rtol``: relative tolerance on the numbers of each release (sensitivity, sigma, ...), for runs whose
    later releases depend on inputs equal only to rounding (PD-SVD's fresh blinding); everything else exact.
    """
    if a["draws"] != b["draws"] or len(a["releases"]) != len(b["releases"]):
        return False
    for ra, rb in zip(a["releases"], b["releases"]):
        if set(ra) != set(rb):
            return False
        for k, va in ra.items():
            vb = rb[k]
            if isinstance(va, float) and isinstance(vb, float):
                if not math.isclose(va, vb, rel_tol=rtol, abs_tol=0.0):
                    return False
            elif va != vb:
                return False
    return True


def party_keys(folder: Path, sites: list[str]) -> tuple[Path, dict[str, Path]]:
    """A consortium's keys: each party's private key file and the keys file pinning every public key."""
    from dpneuro.protocol.exchange.keys import generate_key, write_public_keys

    folder.mkdir(parents=True, exist_ok=True)
    private = {p: folder / f"{p}.key" for p in ["aggregator", *sites]}
    public = {p: generate_key(path) for p, path in private.items()}
    return write_public_keys(folder / "consortium.keys", public), private



def start_parties(cfg, keys_file: Path, private: dict[str, Path], out: dict, run_id: str | None = None) -> list:
    """The aggregator and every site of ``cfg`` (sharedfs.aggregator_main / site_main, each with its own pinned key)
    started in threads; each party's result, or the exception it ended with, lands in ``out``."""
    import threading

    from dpneuro.deploy import sharedfs

    def run(name, fn):
        try:
            out[name] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[name] = exc

    threads = [threading.Thread(target=run, daemon=True, args=("aggregator", lambda: sharedfs.aggregator_main(
        cfg, run_id=run_id, key_file=private["aggregator"], keys_file=keys_file)))]
    for s in cfg.sites:
        threads.append(threading.Thread(target=run, daemon=True, args=(s.name, lambda n=s.name: sharedfs.site_main(
            cfg, n, run_id=run_id, key_file=private[n], keys_file=keys_file))))
    for t in threads:
        t.start()
    return threads
