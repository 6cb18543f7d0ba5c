"""The COINSTAC computation: ``local`` and ``remote`` for ``coinstac.start`` (compspec version 2).

COINSTAC runs a decentralized computation in lock-step iterations: every
site's ``local`` function is called, the files each site wrote to its
``transferDirectory`` move to the remote's ``baseDirectory/<clientId>/``, the
``remote`` function is called with every site's output JSON keyed by site,
the files the remote wrote to its ``transferDirectory`` move to every site's
``baseDirectory``, the remote's output JSON becomes every site's next input,
and so on until the remote returns ``"success": true``.

The analysis is dpneuro's own site and aggregator programs
(:func:`dpneuro.deploy.party.run_site_analysis`,
:func:`~dpneuro.deploy.party.run_aggregator_analysis`) over a
:class:`CoinstacExchange`: a message is an authenticated codec blob
(:mod:`dpneuro.protocol.exchange.codec`: raw little-endian arrays plus a JSON header,
never arrays in JSON) written as one file into the transfer directory and
read from the base directory. When the message a party waits for has not
arrived yet, the exchange raises :class:`~dpneuro.protocol.exchange.Suspend`; the
party's checkpoint already holds everything, so ``local``/``remote`` return
to COINSTAC, and the next iteration resumes at that very phase. Each
iteration thus advances the protocol by one phase; no state lives in process
memory (checkpoints and results are files in the ``cacheDirectory``, or a
hidden folder of the ``outputDirectory``, named by ``clientId``).

Iterations, read from the input keys:

1. ``local``: the computation's inputs (the site's NIfTI files, the owner's
   settings) -> output ``{"dpneuro": {"phase": "hello", "settings": ...}}``.
   ``remote``: every site said hello with the same settings -> it fixes the
   site order (sorted ``clientId``), writes the run manifest and returns it.
2. ``local`` (input has ``"dpneuro"``): the site checks the manifest against
   its own settings (privacy budget, collusion assumption, data grid; refused
   naming the field), loads and validates its subjects and starts capePCA.
3. ... one protocol phase per iteration: capePCA, capeDJICA, summary (sites
   send their ledgers, the remote answers with the reported unmixing).
4. The remote writes the maps (``components.nii.gz``, named in ``components.tsv``), the static FNC
   (``fnc.tsv``), ``privacy.json`` and ``report.html`` to its
   ``outputDirectory``; each site writes its own time courses, maps and
   ledger to its ``outputDirectory``; once every site reports ``done`` the
   remote returns the final output with ``"success": true``.

Message authentication: every party signs its messages with its own Ed25519
key (:mod:`dpneuro.protocol.exchange.keys`), made in its private state folder at the
run's first iteration. A site's public key travels in its first output (over
COINSTAC's authenticated transport, which identifies its client); the remote
pins every site's key and its own in the run manifest, and each site checks
that the manifest pins its own key unchanged. From then on no party, nor
anyone on the path of the message files, can write as another. Every
signature also covers the run's binding, a digest of that manifest (which
holds a random ``run_nonce`` drawn by the remote;
:func:`~dpneuro.protocol.exchange.codec.run_binding`), so a message from
another COINSTAC run, even one with the same settings and pinned keys, is
refused as replayed. An owner input
``public_keys`` (party -> 64 hex digits, from ``dpneuro keygen``) pins the
sites' keys in advance instead (a member then passes its private key file as
``signing_key``).

Lost messages: COINSTAC can lose a transfer file. The remote's output lists
what it still waits for (``missing``) and each site's output what it waits for
(``wait``); a party that had sent that message puts the very same bytes into
its transfer folder again (no new release, no new noise). If the remote waits
for the same thing for ``max_stalled_iterations`` iterations (owner input,
default 8) the run ends with an error naming the sites and the message.

State: a run's first iteration starts from an empty state folder and removes
message files an earlier run left in the same folders; nothing lives in
process memory, so COINSTAC may start a new container every iteration.
Each member receives its own ``report.html`` (the group maps, what it spent,
its subjects' time courses) in its output folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import threading
from pathlib import Path
from typing import Any

from dpneuro.config import ConfigError, RunConfig, SiteEntry, check_colluding
from dpneuro.data.cleaning import STRATEGIES
from dpneuro.data.discovery import BIDS_FILTERS
from dpneuro.deploy.party import (
    AggregatorContext,
    SiteContext,
    check_manifest,
    run_aggregator_analysis,
    run_manifest,
    run_site_analysis,
    write_json,
)
from dpneuro.protocol.driver import RunOptions
from dpneuro.protocol.exchange.base import AGGREGATOR, ExchangeError, Suspend
from dpneuro.protocol.exchange.codec import canonical_json, run_binding
from dpneuro.protocol.exchange.coinstac import MAX_MESSAGE_BYTES, SUFFIX, CoinstacExchange
from dpneuro.protocol.exchange.keys import AGGREGATOR_NAME, PartyKeys, generate_key, load_private_key, public_hex
from dpneuro.run.factory import check_reduction_fits

__all__ = [
    "MAX_MESSAGE_BYTES",
    "OWNER_INPUTS",
    "compspec_defaults",
    "CoinstacExchange",
    "local",
    "remote",
    "settings_from_inputs",
]

#: what authenticates a COINSTAC run's messages (privacy.json and docs/privacy.md say it)
TRANSPORT = (
    "Messages travel through COINSTAC, whose authenticated, encrypted transport (the client's login and "
    "TLS to the remote) identifies the parties in the run's first iteration. Every message is then signed with "
    "its sender's own Ed25519 key, pinned in the run manifest (or pinned by the owner in advance), so neither "
    "a party nor anyone on the path of the message files can write as another; an attacker there could still "
    "withhold messages (the run stops). Privacy rests on the noise, not on the signatures: every site checks "
    "the noise plan it is sent against its own configuration before it releases anything.")
#: iterations the remote may stay in the same wait before it ends the run (owner input max_stalled_iterations)
MAX_STALLED_ITERATIONS = 8
RUN_ID = "coinstac"

#: compspec inputs set by the consortium owner -> (RunConfig field, type); "seed_policy"/"seed" make ``seed``
OWNER_INPUTS: dict[str, type] = {
    "n_components": int, "reduction": str, "ica": str, "plan": str, "n_colluding": int, "delta": float,
    "pca_epsilon": float, "pca_subject_bound": float, "pca_contribution": str,
    "max_memory_gb": float, "ica_epsilon_i": float, "ica_delta_i": float,
    "ica_rounds": int, "ica_unmixing": str, "cumulant_epsilon": float, "clip_G": float, "clip_h": float,
    "ica_clip_unit": str, "ica_bias": bool, "optimizer": str, "calibration": str, "space": str, "parcels": int,
    "site_voxel_maps": bool, "site_maps_method": str,
    "standardize": bool, "min_volumes": int, "simulation": bool, "pdsvd_iterations": int, "brain_states": int,
    "states_epsilon": float, "states_method": str, "states_window": int, "states_step": int, "states_metric": str,
    "fnc": bool, "fnc_epsilon": float, "atlas_fill": int,
    "design": str, "covariates": str, "glm_measures": str, "glm_epsilon": float,
    # the site-local cleaning, the runs read and the features (text inputs: see TEXT_INPUTS)
    "detrend": bool, "high_pass": float, "low_pass": float, "smoothing_fwhm": float, "on_bad_subject": str,
    "atlas": str, "confounds": str, "confounds_options": str, "bids": str,
}
#: fields whose None (off) is the number 0 in COINSTAC, which has no null
OFF_AS_ZERO = ("high_pass", "low_pass", "smoothing_fwhm")
SEED_POLICIES = ("entropy", "fixed")
#: the per-site (member) input: the site's subject files, relative to its baseDirectory
DATA_INPUT = "data"
#: the per-site input naming its participants table (group statistics), relative to its baseDirectory
PARTICIPANTS_INPUT = "participants"

# COINSTAC runs one container per party. A service process that serves several
# parties (tests, dry runs) gets their iterations concurrently in threads; run
# them one at a time: numpy's .npy header parsing (ast.literal_eval) is not
# thread-safe in CPython 3.11 ("AST constructor recursion depth mismatch").
_ONE_PARTY_AT_A_TIME = threading.Lock()



def _value(v: Any) -> Any:
    """An input as COINSTAC passes it (the value), or as written in an inputspec ({"value": ...})."""
    return v["value"] if isinstance(v, dict) and set(v) >= {"value"} else v


def _coerce(name: str, typ: type, v: Any) -> Any:
    """JSON numbers arrive as int or float whatever was meant; make them what the field is."""
    try:
        if typ is bool:
            if not isinstance(v, bool):
                raise TypeError
            return v
        if typ is int:
            if isinstance(v, bool) or float(v) != int(float(v)):
                raise TypeError
            return int(float(v))
        if typ is float:
            if isinstance(v, bool):
                raise TypeError
            return float(v)
        if not isinstance(v, str):
            raise TypeError
        return v
    except (TypeError, ValueError):
        raise ConfigError(f"COINSTAC input {name!r}: expected {typ.__name__}, got {v!r}") from None


def _parse_confounds(text: str) -> str | list[str]:
    """"" (off), a nilearn strategy, or confound columns separated by commas or spaces."""
    words = [w for w in re.split(r"[\s,]+", text.strip()) if w]
    return text.strip() if len(words) <= 1 and (not words or words[0] in STRATEGIES) else words


def _format_confounds(value: str | list[str]) -> str:
    return ", ".join(value) if isinstance(value, (list, tuple)) else value


def _parse_object(name: str, example: str, text: str) -> dict[str, Any]:
    """A text input holding a JSON object ("" for none), refused naming the input with an example."""
    if not text.strip():
        return {}
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"COINSTAC input {name!r}: a JSON object such as {example}, got {text!r} ({exc})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"COINSTAC input {name!r}: a JSON object, got {text!r}")
    return d


def _parse_options(text: str) -> dict[str, Any]:
    """Keyword arguments of the strategy as a JSON object, e.g. {"fd_threshold": 0.3}; "" for none."""
    return _parse_object("confounds_options", '{"fd_threshold": 0.3}', text)


def _format_options(d: dict[str, Any]) -> str:
    return json.dumps(d, sort_keys=True) if d else ""


def _parse_bids(text: str) -> dict[str, str]:
    """BIDS filters written as in file names, e.g. "task-rest space-MNI152NLin2009cAsym res-2" ("ses" or
    "session" for the session)."""
    out = {}
    for word in (w for w in re.split(r"[\s,]+", text.strip()) if w):
        key, sep, label = word.partition("-")
        key = "session" if key == "ses" else key
        if not sep or not label or key not in BIDS_FILTERS:
            raise ConfigError(f"COINSTAC input 'bids': entity-label pairs among "
                              f"{[k if k != 'session' else 'ses' for k in BIDS_FILTERS]} as in BIDS file names, "
                              f"e.g. \"task-rest res-2\"; got {word!r}")
        out[key] = label
    return out


def _format_bids(d: dict[str, str]) -> str:
    return " ".join(f"{'ses' if k == 'session' else k}-{v}" for k, v in d.items())


def _parse_covariates(text: str) -> dict[str, Any]:
    """The design terms' descriptions as a JSON object, e.g. {"group": ["control", "patient"], "age": [18, 80]}."""
    return _parse_object("covariates", '{"group": ["control", "patient"], "age": [18, 80]}', text)


def _parse_words(text: str) -> list[str]:
    return [w for w in re.split(r"[\s,]+", text.strip()) if w]


#: RunConfig fields entered as text in COINSTAC: (text -> value, value -> text)
TEXT_INPUTS = {"confounds": (_parse_confounds, _format_confounds),
               "confounds_options": (_parse_options, _format_options), "bids": (_parse_bids, _format_bids),
               "covariates": (_parse_covariates, _format_options),
               "glm_measures": (_parse_words, lambda v: ", ".join([v] if isinstance(v, str) else v))}


def compspec_defaults() -> dict[str, Any]:
    """The default of every owner input as compspec.json must give it: RunConfig's, in COINSTAC's terms."""
    defaults = RunConfig(sites=[], out="")
    out = {}
    for name in OWNER_INPUTS:
        v = getattr(defaults, name)
        if name in TEXT_INPUTS:
            v = TEXT_INPUTS[name][1](v)
        elif v is None:
            v = -1 if name == "n_colluding" else 0
        out[name] = v
    return out


def settings_from_inputs(inputs: dict[str, Any], *, n_sites: int | None = None) -> dict[str, Any]:
    """The consortium settings (RunConfig fields) from the computation's inputs; defaults for missing ones.

    ``n_sites``: the number of sites when known (the remote's set-up knows it; a site's first iteration does
    not), to refuse a collusion assumption CAPE does not cover here already (the configuration refuses it too).
    """
    inputs = {k: _value(v) for k, v in inputs.items()}
    defaults = RunConfig(sites=[], out="")
    out: dict[str, Any] = {}
    for name, typ in OWNER_INPUTS.items():
        out[name] = _coerce(name, typ, inputs[name]) if inputs.get(name) is not None else getattr(defaults, name)
        if name in TEXT_INPUTS and inputs.get(name) is not None:
            out[name] = TEXT_INPUTS[name][0](out[name])
    if out["n_colluding"] is not None and out["n_colluding"] < -1:
        raise ConfigError(f"COINSTAC input 'n_colluding': {out['n_colluding']}; give the number of sites that may "
                          "collude with the aggregator (>= 0), or -1 for the most CAPE allows, ceil(S/3) - 1")
    if out["n_colluding"] == -1:
        out["n_colluding"] = None  # -1: the most CAPE allows, ceil(S/3) - 1
    if n_sites is not None:
        check_colluding(out["plan"], out["n_colluding"], n_sites)
    for name in OFF_AS_ZERO:
        if out[name] is not None and out[name] == 0:
            out[name] = None
    policy = inputs.get("seed_policy", "entropy")
    if policy not in SEED_POLICIES:
        raise ConfigError(f"COINSTAC input 'seed_policy': one of {SEED_POLICIES}, got {policy!r}")
    out["seed"] = _coerce("seed", int, inputs.get("seed", 0)) if policy == "fixed" else None
    if out["seed"] is not None and not out["simulation"]:
        raise ConfigError("COINSTAC input 'seed_policy': 'fixed' seeds every party's noise from a value all "
                          "parties see, so anyone could regenerate a site's noise and remove it; use 'entropy' "
                          "(a test or simulation may set the input 'simulation' to true to keep a fixed seed)")
    return out


def _files(inputs: dict[str, Any], base_dir: Path) -> list[str]:
    files = _value(inputs.get(DATA_INPUT))
    if isinstance(files, str):
        files = [files]
    if not files or not all(isinstance(f, str) for f in files):
        raise ConfigError(f"COINSTAC input {DATA_INPUT!r}: a list of this site's NIfTI files, got {files!r}")
    return [str(base_dir / f) for f in files]


def _signing_key(sd: Path, inputs_key: Any = None):
    """This party's private key: the member's own key file (input ``signing_key``), else one made in its state
    folder at the run's first iteration and kept for the run."""
    if inputs_key:
        return load_private_key(inputs_key)
    path = sd / "party.key"
    if not path.exists():
        generate_key(path)
    return load_private_key(path)


def _party_keys(manifest: dict[str, Any], me: str, private) -> PartyKeys:
    pinned = manifest.get("public_keys") or {}
    if me in pinned and pinned[me] != public_hex(private):
        raise ConfigError(f"COINSTAC party {me!r} refuses the run manifest: it pins another public key for "
                          f"{me!r} than this party's own ({public_hex(private)[:16]}...)")
    return PartyKeys(me, private, pinned, manifest["sites"])


def _state_dir(state: dict[str, Any], role: str, *, fresh: bool = False) -> Path:
    """This party's private folder: in the cacheDirectory if COINSTAC gives one, named by clientId and run.

    ``fresh=True`` (a run's first iteration) removes what an earlier run left
    there: COINSTAC may reuse the same folders (the simulator always does), and
    a new run must never continue an old one's state.
    """
    root = state.get("cacheDirectory") or os.path.join(state["outputDirectory"], ".dpneuro-cache")
    cid = str(state.get("clientId", role))
    run = hashlib.sha256(str(state.get("baseDirectory", "")).encode()).hexdigest()[:10]
    path = Path(root) / f"dpneuro-{role}-{re.sub(r'[^A-Za-z0-9_.-]', '_', cid)}-{run}"
    if fresh and path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _clear_messages(folder) -> None:
    """Remove this computation's message files from ``folder`` (at a run's start: an earlier run's)."""
    d = Path(folder)
    if d.is_dir():
        for p in d.glob(f"*{SUFFIX}"):
            p.unlink(missing_ok=True)


def _config(settings: dict[str, Any], sites: list[str], out: Path, own: tuple[str, list[str]] | None = None,
            participants: str = ""):
    entries = [SiteEntry(name=s, path="", files=list(own[1]) if own and own[0] == s else [],
                         participants=participants if own and own[0] == s else "") for s in sites]
    return RunConfig(sites=entries, out=str(out), **settings)


# -- the two functions COINSTAC calls -----------------------------------------------------------

def _strict_json(obj: Any) -> Any:
    """``obj`` with non-finite numbers as text: COINSTAC parses replies with JSON.parse, which has no Infinity
    (a run that is not differentially private reports epsilon = inf)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict_json(v) for v in obj]
    return obj


def local(args: dict[str, Any]) -> dict[str, Any]:
    """A site's iteration (see the module notes); returns ``{"output": ..., "cache": ...}``."""
    with _ONE_PARTY_AT_A_TIME:
        return _strict_json(_local(args))


def remote(args: dict[str, Any]) -> dict[str, Any]:
    """The remote's iteration (see the module notes); adds ``"success": true`` at the end."""
    with _ONE_PARTY_AT_A_TIME:
        return _strict_json(_remote(args))


def _local(args: dict[str, Any]) -> dict[str, Any]:
    state, inputs = args["state"], args.get("input") or {}
    me = str(state["clientId"])
    first = "dpneuro" not in inputs  # the run's first iteration
    sd = _state_dir(state, "site", fresh=first)
    if first:
        _clear_messages(state["baseDirectory"])  # an earlier run's broadcasts, left in the same folder
    _clear_messages(state["transferDirectory"])  # the last iteration's: COINSTAC has delivered them
    if "dpneuro" not in inputs:  # first iteration: the computation's inputs
        settings = settings_from_inputs(inputs)
        files = _files(inputs, Path(state["baseDirectory"]))
        key_file = _value(inputs.get("signing_key")) or None
        pinned = _value(inputs.get("public_keys")) or {}
        if not isinstance(pinned, dict):
            raise ConfigError(f"COINSTAC input 'public_keys': party -> public key (64 hex digits), got {pinned!r}")
        table = _value(inputs.get(PARTICIPANTS_INPUT)) or "participants.tsv"
        participants = str(Path(state["baseDirectory"]) / table) if settings.get("design") else ""
        if participants and not Path(participants).is_file():
            raise ConfigError(f"COINSTAC input {PARTICIPANTS_INPUT!r}: the design needs this site's participants "
                              f"table, and {table!r} is not in its data folder")
        write_json(sd / "inputs.json", {"settings": settings, "files": files, "signing_key": key_file,
                                        "participants": participants})
        public = public_hex(_signing_key(sd, key_file))
        limit = _coerce("max_stalled_iterations", int,
                        _value(inputs.get("max_stalled_iterations", MAX_STALLED_ITERATIONS)))
        if limit < 1:
            raise ConfigError(f"COINSTAC input 'max_stalled_iterations': must be >= 1, got {limit}")
        return {"output": {"dpneuro": {"phase": "hello", "settings": settings, "n_files": len(files),
                                       "max_stalled_iterations": limit, "public_key": public,
                                       "pinned_keys": pinned}},
                "cache": {"dpneuro": "hello"}}
    if not (sd / "inputs.json").exists():
        raise RuntimeError(f"site {me!r}: its state folder {sd} lost the inputs of iteration 1")
    saved = json.loads((sd / "inputs.json").read_text())
    manifest = inputs["dpneuro"]["manifest"]
    if me not in manifest["sites"]:
        raise ConfigError(f"site {me!r} is not in the run manifest's sites {manifest['sites']}")
    cfg = _config(saved["settings"], manifest["sites"], sd / "work", (me, saved["files"]),
                  saved.get("participants", ""))
    cfg.validate(data_sites=[me])
    check_manifest(cfg, manifest, party=f"COINSTAC site {me!r}", source="the remote's run manifest")
    key = _party_keys(manifest, me, _signing_key(sd, saved.get("signing_key")))
    index, n = manifest["sites"].index(me), len(manifest["sites"])
    # the manifest as checked here and as the remote wrote it (canonical JSON: Node's rewriting changes nothing)
    binding = run_binding(RUN_ID, manifest)

    def exchange(stage: str) -> CoinstacExchange:
        return CoinstacExchange(run_id=stage, key=key, n_sites=n, base_dir=state["baseDirectory"],
                                transfer_dir=state["transferDirectory"], state_dir=sd / "exchange" / stage,
                                site=index, binding=binding)

    for m in inputs["dpneuro"].get("missing") or []:
        if me in m.get("sites", []):  # COINSTAC lost a message of ours: the same bytes again, no new release
            exchange(m["stage"]).resend(index, int(m["round"]), m["topic"])
    ctx = SiteContext(cfg=cfg, site=me, work=sd / "work", out=Path(state["outputDirectory"]), exchange=exchange,
                      message_limit=MAX_MESSAGE_BYTES)
    try:
        res = run_site_analysis(ctx)
    except Suspend as s:
        wait = {"stage": s.run_id, "round": s.round, "topic": s.topic}
        return {"output": {"dpneuro": {"phase": "running", "waiting": str(s), "wait": wait}},
                "cache": {"dpneuro": "running"}}
    return {"output": {"dpneuro": {"phase": "done", "epsilon": res["epsilon"]}},
            "cache": {"dpneuro": "done"}}


def _remote_setup(outs: dict[str, dict], sd: Path) -> dict[str, Any]:
    """Iteration 1 of the remote: every site said hello with the same settings -> the run manifest."""
    not_hello = sorted(c for c, o in outs.items() if o.get("phase") != "hello")
    if not_hello:
        raise RuntimeError(f"remote: sites {not_hello} are past set-up but the remote has no run manifest "
                           f"in {sd} (its state folder was lost)")
    sites = sorted(outs)
    first = outs[sites[0]]["settings"]
    for c in sites[1:]:
        for k in sorted(set(first) | set(outs[c]["settings"])):
            if canonical_json(first.get(k)) != canonical_json(outs[c]["settings"].get(k)):
                raise ConfigError(f"config field {k!r}: site {c!r} has {outs[c]['settings'].get(k)!r} but site "
                                  f"{sites[0]!r} has {first.get(k)!r}; every site must run the same settings")
    cfg = _config(first, sites, sd / "work").validate(data_sites=[])
    manifest = run_manifest(cfg, RUN_ID)
    pinned = outs[sites[0]].get("pinned_keys") or {}
    for c in sites:
        if canonical_json(outs[c].get("pinned_keys") or {}) != canonical_json(pinned):
            raise ConfigError(f"COINSTAC input 'public_keys': site {c!r} holds other pinned keys than site "
                              f"{sites[0]!r}; every site must get the owner's same keys")
        announced = outs[c].get("public_key")  # keys pinned in advance win; else each site's own, as delivered
        if c in pinned and announced != pinned[c]:
            raise ConfigError(f"COINSTAC site {c!r} announced a public key other than the one the owner pinned "
                              "(input 'public_keys'); the remote refuses to run with it")
    manifest["public_keys"] = {**{c: pinned.get(c) or outs[c].get("public_key") for c in sites},
                               AGGREGATOR_NAME: public_hex(_signing_key(sd))}
    # two runs with the same settings and pinned keys still bind their messages differently (run_binding)
    manifest["run_nonce"] = secrets.token_hex(16)
    grid = manifest["grid"]
    dim = min(cfg.parcels, grid["n_voxels"]) if cfg.parcels else grid["n_voxels"]
    check_reduction_fits(cfg, dim, MAX_MESSAGE_BYTES)  # COINSTAC moves files of at most 10 MB
    write_json(sd / "settings.json", first)
    write_json(sd / "limits.json", {"max_stalled_iterations": min(int(outs[c].get("max_stalled_iterations")
                                                                      or MAX_STALLED_ITERATIONS) for c in sites)})
    write_json(sd / "manifest.json", manifest)
    return manifest


def _check_progress(sd: Path, signature: list, waiting: str) -> None:
    """End the run when the remote waits for the same thing iteration after iteration (a message that stays lost)."""
    path = sd / "progress.json"
    last = json.loads(path.read_text()) if path.exists() else {}
    same = canonical_json(last.get("signature")) == canonical_json(signature)
    count = int(last.get("count", 0)) + 1 if same else 1
    limits = sd / "limits.json"
    limit = json.loads(limits.read_text())["max_stalled_iterations"] if limits.exists() else MAX_STALLED_ITERATIONS
    if count > limit:
        raise ExchangeError(f"no progress for {count - 1} COINSTAC iterations: {waiting}; the missing message "
                            "was re-sent and did not arrive (is a site's transfer failing?)")
    write_json(path, {"signature": signature, "count": count})


def _remote(args: dict[str, Any]) -> dict[str, Any]:
    state, inputs = args["state"], args.get("input") or {}
    outs = {str(c): dict((o or {}).get("dpneuro", {})) for c, o in inputs.items()}
    # every site says hello only in a run's first iteration
    first = bool(outs) and all(o.get("phase") == "hello" for o in outs.values())
    sd = _state_dir(state, "remote", fresh=first)
    if first:
        for c in outs:
            _clear_messages(Path(state["baseDirectory"]) / c)
    _clear_messages(state["transferDirectory"])  # the last iteration's: COINSTAC has delivered them
    manifest = (json.loads((sd / "manifest.json").read_text()) if (sd / "manifest.json").exists()
                else _remote_setup(outs, sd))
    settings = json.loads((sd / "settings.json").read_text())
    cfg = _config(settings, manifest["sites"], sd / "work")
    key = _party_keys(manifest, AGGREGATOR_NAME, _signing_key(sd))
    binding = run_binding(RUN_ID, manifest)

    def exchange(stage: str) -> CoinstacExchange:
        return CoinstacExchange(run_id=stage, key=key, n_sites=len(manifest["sites"]),
                                base_dir=state["baseDirectory"], transfer_dir=state["transferDirectory"],
                                state_dir=sd / "exchange" / stage, site_dirs=manifest["sites"], binding=binding)

    for o in outs.values():  # a site still waits for a broadcast already sent: COINSTAC lost it
        w = o.get("wait")
        if w and w.get("stage"):
            exchange(w["stage"]).resend(AGGREGATOR, int(w["round"]), w["topic"])
    out_dir = Path(state["outputDirectory"])
    ctx = AggregatorContext(cfg=cfg, work=sd / "work", out=out_dir, exchange=exchange,
                            options=RunOptions(timeout=None), transport=TRANSPORT)
    try:
        res = run_aggregator_analysis(ctx)
    except Suspend as s:
        names = [manifest["sites"][i] for i in (s.missing or [])]
        missing = [{"stage": s.run_id, "round": s.round, "topic": s.topic, "sites": names}] if names else []
        _check_progress(sd, ["running", s.run_id, s.round, s.topic, names], str(s))
        return {"output": {"dpneuro": {"manifest": manifest, "phase": "running", "waiting": str(s),
                                       "missing": missing}},
                "cache": {"dpneuro": "running"}}
    pending = [c for c in manifest["sites"] if outs.get(c, {}).get("phase") != "done"]
    if pending:
        _check_progress(sd, ["finishing", pending, [outs.get(c, {}).get("waiting") for c in pending]],
                        f"the remote waits for sites {pending} to finish")
        return {"output": {"dpneuro": {"manifest": manifest, "phase": "finishing", "pending": pending}},
                "cache": {"dpneuro": "finishing"}}
    final = {k: res[k] for k in ("sites", "ica_rounds", "ica_status", "epsilon", "delta", "plan", "signal",
                                 "signal_components")}
    for k in ("components", "component_table", "fnc", "group_effects", "privacy", "report", "W", "basis", "states"):
        if res.get(k):
            final[k] = os.path.relpath(res[k], out_dir)  # files in the remote's outputDirectory
    return {"output": final, "cache": {"dpneuro": "done"}, "success": True}
