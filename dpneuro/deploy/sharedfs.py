"""``dpneuro site`` / ``dpneuro aggregator``: one role of a run per process, over a shared folder.

A consortium without COINSTAC runs the analysis across machines that mount
one shared folder (``exchange_dir`` in the configuration: NFS, SMB, a synced
cloud folder with atomic renames). Layout of a run::

    <exchange_dir>/<run_id>/manifest.json     the run manifest (written by the aggregator)
    <exchange_dir>/<run_id>/reduce/...        capePCA messages (DirectoryExchange)
    <exchange_dir>/<run_id>/unmix/...         capeDJICA messages
    <exchange_dir>/<run_id>/summary/...       ledgers in, reported unmixing out
    <exchange_dir>/<run_id>/failed/<party>-<hash>.json  a party that stopped: how, when and why (signed)
    <exchange_dir>/<run_id>/keys/<party>.pub  published public keys (simulations only)

Trust assumptions (docs/privacy.md, "Threat model"). Every party signs what it
sends with its own Ed25519 key (``--key-file``, made by ``dpneuro keygen``)
and checks every message against the public keys the consortium pinned out of
band in one keys file (``--keys``), so no party can write as another and
nothing secret lies in the shared folder. Every signature (messages and
failure notices) also covers the run's binding: its run id and the SHA-256 of
its run manifest as each party computes it from its own configuration
(:func:`~dpneuro.protocol.exchange.codec.run_binding`), so a message copied
from another run's folder is refused as replayed. A run without a keys file is
refused unless the configuration says it is a simulation (then each party
publishes its public key in the shared folder: trust on first use).

The shared folder holds nothing a party follows: no party reads, writes or
removes anything there through a symlink or a non-regular file, nor through a
folder that is not a real one (:mod:`~dpneuro.protocol.exchange.safefs`
refuses it by name), and a party refuses to start when its ``out``, its
``--key-file`` or its ``--keys`` lies inside ``exchange_dir``. What is
*in* the messages is protected regardless of who reads the folder: only
CAPE-noised or secure-aggregation-masked arrays and public metadata leave a
site, and each site checks the noise plan it is sent against its own
configuration before it releases anything.

Outputs go to ``<out>/<run_id>/`` (the aggregator's: maps, privacy.json,
report.html) and ``<out>/<run_id>/<site>/`` (a site's own), so a run with
another id never overwrites an earlier run's; the default run id is
``dpneuro`` (:data:`~dpneuro.config.DEFAULT_RUN_ID`, or the configuration's
``run_id``). Each party keeps its own progress under ``<out>/.dpneuro/<run_id>/<party>/``
(checkpoints and intermediate results; a site's hold un-noised statistics of
its data, so this folder stays private); a new run id starts afresh. A party
that fails leaves a notice in ``<exchange_dir>/<run_id>/failed/`` so that the
others stop at once with its name and error (each leaving a notice that it
stopped too); a party stopped by its operator (Ctrl-C) leaves one that makes
the others wait for it instead, up to their message timeout (``timeout``). A
killed or stopped party started again with the same command and run id
resumes where it stopped: it re-sends the message it had written ahead
instead of computing it again, so nothing is ever released twice. Every
party's stop message names the commands that go on with the run; a party
started again after the run stopped says at once who stopped, when and why,
and waits for the others to be started again (in any order) rather than
stopping on their old notices.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dpneuro._utils.errors import DpneuroError
from dpneuro.config import DEFAULT_RUN_ID, ConfigError, RunConfig
from dpneuro.deploy.party import (
    AggregatorContext,
    ManifestMismatch,
    SiteContext,
    check_manifest,
    run_aggregator_analysis,
    run_manifest,
    run_site_analysis,
)
from dpneuro.protocol.driver import RunOptions
from dpneuro.protocol.exchange import DirectoryExchange, ExchangeError, PartyFailed, safefs
from dpneuro.protocol.exchange.codec import check_name, run_binding
from dpneuro.protocol.exchange.directory import (
    FAILED,
    INTERRUPTED,
    STOPPED,
    check_failure_notices,
    clear_failure_notice,
    publish_once,
    read_notices,
    reserve_failure_notice,
    write_failure_notice,
)
from dpneuro.protocol.exchange.keys import (
    AGGREGATOR_NAME,
    KeyFileError,
    PartyKeys,
    generate_key,
    load_private_key,
    public_hex,
    read_public_keys,
)

__all__ = ["DEFAULT_RUN_ID", "WaitTimeout", "aggregator_main", "load_party_config", "run_folder", "site_main"]

_POLL = 0.05


class WaitTimeout(DpneuroError, RuntimeError):
    """Something another party should have written to the shared folder did not appear in time."""


def load_party_config(path, *, site: str | None = None) -> RunConfig:
    """Read a run configuration for one party: only ``site``'s data (if any) must exist here."""
    cfg = RunConfig.read(path)
    if site is not None and site not in [s.name for s in cfg.sites]:
        raise ConfigError(f"config field 'sites': no site named {site!r} in {path} "
                          f"(sites: {[s.name for s in cfg.sites]})")
    cfg.validate(data_sites=[site] if site is not None else [])
    cfg.check_deployment(f"site {site!r}" if site is not None else "the aggregator")
    if not cfg.exchange_dir:
        raise ConfigError("config field 'exchange_dir': a site/aggregator run needs the shared folder")
    return cfg


def run_folder(cfg: RunConfig, run_id: str) -> Path:
    return Path(cfg.exchange_dir) / check_name("run id", run_id)


def _shared(cfg: RunConfig) -> Path:
    """The shared folder's root: below it nothing is followed through a symlink (safefs)."""
    return Path(cfg.exchange_dir)


def _inside(path, folder) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def _check_private(cfg: RunConfig, me: str, key_file, keys_file) -> None:
    """Refuse a party whose private files would lie in the shared folder, where anyone with access could read or
    swap them: its outputs and progress (``out``), its private key, the public keys it pins."""
    shared = cfg.exchange_dir
    if _inside(cfg.out, shared):
        raise ConfigError(f"{me}: config field 'out' ({cfg.out}) is inside config field 'exchange_dir' ({shared}): "
                          "a party's outputs, private progress and default key must not lie in the shared folder; "
                          "choose an 'out' outside it")
    for flag, path in (("--key-file", key_file), ("--keys", keys_file)):
        if path and _inside(path, shared):
            raise ConfigError(f"{me}: {flag} {path} is inside config field 'exchange_dir' ({shared}): whoever can "
                              "write to the shared folder could read or replace it; keep it outside")


def _own_key(cfg: RunConfig, me: str, key_file, pinned: bool):
    """This party's private key: ``key_file``, else its default place in the party's private folder (made there on
    first use only when nothing is pinned, i.e. in a simulation)."""
    path = Path(key_file) if key_file else Path(cfg.out) / ".dpneuro" / "keys" / f"{me}.key"
    if not path.exists() and not key_file and not pinned:
        public = generate_key(path)
        print(f"{me}: made its signing key {path} (public key {public})", file=sys.stderr, flush=True)
    if not path.exists():
        raise KeyFileError(f"{me}: no private key at {path}: pass --key-file with the key made by "
                           "`dpneuro keygen` whose public key the consortium pinned in its keys file")
    return load_private_key(path)


def _published_keys(cfg: RunConfig, folder: Path, me: str, private, timeout: float | None,
                    before: dict[str, bytes] | None = None) -> dict[str, str]:
    """Trust on first use, for simulations only: each party publishes its public key in the shared folder and
    takes the others' from there; a name already published with another key is refused."""
    keys_dir, base = folder / "keys", _shared(cfg)
    mine = public_hex(private)
    publish_once(keys_dir / f"{me}.pub", mine.encode(), base=base)
    have = (safefs.read(base, keys_dir / f"{me}.pub") or b"").decode("ascii", "replace").strip()
    if have != mine:
        raise KeyFileError(f"{me}: another key is already published as {me!r} in {keys_dir}: another process uses "
                           "this party's name (or an earlier run with other keys used this run id)")
    out = {}
    for party in [AGGREGATOR_NAME, *[s.name for s in cfg.sites]]:
        path = keys_dir / f"{party}.pub"
        _wait_for(path, timeout, f"{party}'s public key", folder, me, base, before)
        out[party] = (safefs.read(base, path) or b"").decode("ascii", "replace").strip()
    return out


def _party_keys(cfg: RunConfig, folder: Path, me: str, key_file, keys_file,
                before: dict[str, bytes] | None = None) -> PartyKeys:
    """This party's signing key and every party's public key, pinned by the consortium's keys file."""
    sites = [s.name for s in cfg.sites]
    if keys_file:
        private = _own_key(cfg, me, key_file, pinned=True)
        return PartyKeys(me, private, read_public_keys(keys_file), sites)
    if not cfg.simulation:
        raise ConfigError(
            f"{me} refuses to run without the consortium's keys file (--keys): every party signs what it sends "
            "with its own key, and only public keys pinned out of band stop one party from writing as another. "
            "Each party runs `dpneuro keygen <its key file>` and hands out the public key it prints; the "
            "consortium collects them into one file (`aggregator = \"...\"`, `site-01 = \"...\"`, ...) that every "
            "party passes with --keys, and its own key with --key-file. (A test or simulation may set "
            "simulation = true to publish keys in the shared folder instead.)")
    private = _own_key(cfg, me, key_file, pinned=False)
    return PartyKeys(me, private, _published_keys(cfg, folder, me, private, cfg.timeout, before), sites)


def _check_writable(path: Path, what: str) -> None:
    """Refuse, before anything is released, an output folder this party cannot write."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dpneuro-write-check."):
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be written ({exc.strerror or exc}); nothing was released") from None


def _wait_for(path: Path, timeout: float | None, what: str, folder: Path, me: str, base: Path,
              before: dict[str, bytes] | None = None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    if not safefs.is_file(base, path):  # a site started before its aggregator says what it waits for, once
        limit = "without a time limit" if timeout is None else f"for up to {timeout:g} s"
        print(f"{me}: waiting {limit} for {what} ({path}): start `dpneuro aggregator` with the same "
              "exchange_dir and run id", file=sys.stderr, flush=True)
    while not safefs.is_file(base, path):
        check_failure_notices(folder, me, base=base, before=before)
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"waited {timeout} s for {what} ({path}); is the aggregator running with the "
                               "same exchange_dir and run id?")
        time.sleep(_POLL)


def _read_manifest(path: Path, base: Path) -> Any:
    try:
        return json.loads(safefs.read(base, path) or b"")
    except ValueError as exc:
        raise ManifestMismatch(f"{path} is not a run manifest (not JSON: {exc})") from None


def _publish_manifest(path: Path, manifest: dict[str, Any], base: Path) -> None:
    """Write the manifest once; an existing one must be this run's (a restarted aggregator)."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    if not publish_once(path, text.encode(), base=base) and _read_manifest(path, base) != json.loads(text):
        raise ManifestMismatch(
            f"{path} already describes a run with different settings; this aggregator refuses to "
            f"continue it (use another --run-id, or remove {path.parent} to start over)")


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _exchange_factory(folder: Path, cfg: RunConfig, key: PartyKeys, binding: str, progress: bool = False,
                      before: dict[str, bytes] | None = None):
    """The run's exchanges, one per stage (``run_id=stage``), every signature bound to the run (``binding``);
    ``before``: the other parties' notices of an earlier attempt (they do not stop a restarted party)."""
    names = [s.name for s in cfg.sites]
    try:
        [check_name("site name", n) for n in names]
    except ValueError:
        names = None  # names that cannot be file names: the exchange numbers the sites instead

    def make(stage: str) -> DirectoryExchange:
        return DirectoryExchange(folder, len(cfg.sites), run_id=stage, key=key, site_names=names,
                                 notify=_say if progress else None, binding=binding, base=_shared(cfg),
                                 notices_before=before)

    return make


def _with_run_id(cfg: RunConfig, run_id: str | None) -> tuple[RunConfig, str]:
    """``cfg`` with absolute paths and the run id (``run_id``, else the configuration's) it runs under."""
    cfg = cfg.resolved()
    if run_id is not None and run_id != cfg.run_id:
        cfg = replace(cfg, run_id=check_name("run id", run_id))
    return cfg, cfg.run_id


def _party_work(cfg: RunConfig, run_id: str, party: str) -> Path:
    """A party's private progress, keyed by the run id: a new run id never reuses an old run's state."""
    return Path(cfg.out) / ".dpneuro" / run_id / party


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"the disk holding {exc.filename or 'its files'} is full (no space left on device)"
    if isinstance(exc, KeyboardInterrupt):
        return "stopped by its operator (interrupted)"
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _who(party: str) -> str:
    return "the aggregator" if party == AGGREGATOR_NAME else f"site {party!r}"


def _capital(words: str) -> str:
    return words[:1].upper() + words[1:]


def _command(party: str, run_id: str, key_file=None, keys_file=None) -> str:
    """The command that runs ``party`` in run ``run_id`` (CONFIG: its configuration file; KEY, KEYS: its key file
    and the consortium's keys file, unless given)."""
    role = "aggregator CONFIG" if party == AGGREGATOR_NAME else f"site CONFIG --site {party}"
    return (f"dpneuro {role} --run-id {run_id}" + (f" --key-file {key_file}" if key_file else "")
            + (f" --keys {keys_file}" if keys_file else ""))


def _restart_hint(cfg: RunConfig, run_id: str, signed: bool) -> str:
    """What every party runs to go on with a stopped run: which parties, with which run id."""
    keys = " --key-file KEY --keys KEYS" if signed else ""
    return (f"start every party again with run id {run_id!r} (each resumes from its checkpoint; nothing is released "
            f"twice): the aggregator with `dpneuro aggregator CONFIG --run-id {run_id}{keys}` and each site "
            f"({', '.join(s.name for s in cfg.sites)}) with `dpneuro site CONFIG --site NAME --run-id {run_id}{keys}`, "
            + ("CONFIG and KEY being that party's own configuration and key file, KEYS the consortium's keys file"
               if signed else "CONFIG being that party's own configuration"))


def _limit(timeout: float | None) -> str:
    return "without a time limit" if timeout is None else f"up to {timeout:g} s for each message"


def _restart_note(cfg: RunConfig, run_id: str, party: str, others: list, again: bool, signed: bool) -> str | None:
    """What a party started while other parties' notices lie in the shared folder says at once, if anything."""
    stopped = [n for n in others if n.kind != INTERRUPTED]
    said = "; ".join(n.describe() for n in others)
    if stopped and again:
        return (f"{_who(party)}: run {run_id!r} was stopped: {said}. To go on, {_restart_hint(cfg, run_id, signed)}. "
                f"{_capital(_who(party))} takes part again and waits for the others ({_limit(cfg.timeout)})")
    if others and not stopped:
        return (f"{_who(party)}: {said}; run {run_id!r} waits for it to be started again with the same run id "
                f"({_limit(cfg.timeout)})")
    return None  # another party's failure of this attempt: the first look at the notices stops this party


def _reporting(folder: Path, base: Path, party: str, run, *, cfg: RunConfig, run_id: str, key_file=None,
               keys_file=None):
    """Run ``run(signer)``; if it stops, leave a notice naming ``party``, and say what to run to go on.

    A failure's notice stops the other parties at once; an operator's stop (Ctrl-C) makes them wait for this party
    to be started again (up to their message timeout); a party stopped by another's failure leaves a notice that it
    stopped too, so that a party started again later says at once that the run was stopped and what to run. A
    party started again (its own notice, or another's saying the run stopped, lies in the shared folder) says so
    and waits for the parties those notices name instead of stopping on them (``signer["before"]``).

    The notice's space is set aside first (a full disk can still carry it), and it is signed with the party's key,
    for this run, once ``run`` has put them in ``signer["keys"]`` and ``signer["binding"]``.
    """
    safefs.make_folder(base, folder)
    found = read_notices(folder, base=base)
    others = [n for n in found if n.party != party]
    again = len(others) < len(found) or any(n.kind == STOPPED for n in others)
    signed = keys_file is not None
    if note := _restart_note(cfg, run_id, party, others, again, signed):
        _say(note)
    clear_failure_notice(folder, party, base=base)  # a restarted party is alive again
    reserve_failure_notice(folder, party, base=base)
    signer: dict[str, Any] = {"before": {n.name: n.raw for n in others} if again else None}
    who, hint = _who(party), _restart_hint(cfg, run_id, signed)

    def notice(kind: str, error: str) -> None:
        try:
            write_failure_notice(folder, party, error, signer.get("keys"), binding=signer.get("binding"), base=base,
                                 kind=kind)
        except (OSError, ExchangeError) as notice_exc:  # ExchangeError: a file planted where the notice goes
            print(f"{party}: could not leave a failure notice in {folder} ({notice_exc}); the other parties "
                  "stop at their timeout", file=sys.stderr)

    try:
        return run(signer)
    except PartyFailed as exc:  # another party's failure: it left its own notice; this one says it stopped too
        notice(STOPPED, str(exc))
        raise PartyFailed(f"{str(exc).rstrip('.')}. {_capital(who)} stopped too; to go on, {hint}") from exc
    except KeyboardInterrupt as exc:
        notice(INTERRUPTED, _why(exc))
        command = _command(party, run_id, key_file, keys_file)
        _say(f"{who}: stopped by its operator; the other parties of run {run_id!r} wait for it "
             f"({_limit(cfg.timeout)}): start it again with the same run id, `{command}`, and it resumes from its "
             f"checkpoint. If they have stopped by then, {hint}")
        raise
    except BaseException as exc:
        notice(FAILED, _why(exc))
        _say(f"{who} stopped with an error, and so do the other parties of run {run_id!r}. Once its cause is "
             f"fixed, {hint}")
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise OSError(exc.errno, _why(exc)) from exc
        raise


def aggregator_main(cfg: RunConfig, *, run_id: str | None = None, key_file=None, keys_file=None,
                    progress: bool = False) -> dict[str, Any]:
    """Run the aggregator of ``cfg`` over ``exchange_dir``; write the consortium outputs to ``<cfg.out>/<run_id>/``.

    ``run_id``: default the configuration's. Writes the run manifest and
    (without ``key_file``) the run key first, then waits for the sites; every
    wait is bounded by ``cfg.timeout``, and a site that fails ends the wait at
    once with its name and error.
    """
    cfg, run_id = _with_run_id(cfg, run_id)
    folder = run_folder(cfg, run_id)

    def run(signer: dict[str, Any]) -> dict[str, Any]:
        _check_private(cfg, "the aggregator", key_file, keys_file)
        out = cfg.run_dir
        _check_writable(out, "the aggregator's output folder")
        _check_writable(_party_work(cfg, run_id, "aggregator"), "the aggregator's working folder")
        manifest = run_manifest(cfg, run_id)
        _publish_manifest(folder / "manifest.json", manifest, _shared(cfg))
        signer["binding"] = binding = run_binding(run_id, manifest)
        keys = signer["keys"] = _party_keys(cfg, folder, AGGREGATOR_NAME, key_file, keys_file, signer["before"])
        transport = ("Every message is signed with its sender's own Ed25519 key and checked against the public "
                     "keys " + ("the consortium pinned in its keys file (--keys): no party can write as another."
                                if keys_file else "the parties published in the shared folder (a simulation: "
                                "trust on first use)."))
        ctx = AggregatorContext(cfg=cfg, work=_party_work(cfg, run_id, "aggregator"), out=out,
                                exchange=_exchange_factory(folder, cfg, keys, binding, progress, signer["before"]),
                                options=RunOptions(timeout=cfg.timeout, progress=progress), transport=transport)
        return run_aggregator_analysis(ctx)

    return _reporting(folder, _shared(cfg), AGGREGATOR_NAME, run, cfg=cfg, run_id=run_id, key_file=key_file,
                      keys_file=keys_file)


def site_main(cfg: RunConfig, site: str, *, run_id: str | None = None, key_file=None,
              keys_file=None, progress: bool = False) -> dict[str, Any]:
    """Run site ``site`` of ``cfg`` over ``exchange_dir``; its outputs go to ``<cfg.out>/<run_id>/<site>/``.

    ``run_id``: default the configuration's.

    Refuses to start (:class:`~dpneuro.deploy.party.ManifestMismatch`, naming
    the field) if its configuration disagrees with the aggregator's manifest.
    If it fails (bad data, a crash), it leaves a notice in the shared folder so
    that the aggregator and the other sites stop within seconds, naming it.
    """
    cfg, run_id = _with_run_id(cfg, run_id)
    folder = run_folder(cfg, run_id)

    def run(signer: dict[str, Any]) -> dict[str, Any]:
        _check_private(cfg, f"site {site!r}", key_file, keys_file)
        manifest_path = folder / "manifest.json"
        _wait_for(manifest_path, cfg.timeout, "the aggregator's run manifest", folder, site, _shared(cfg),
                  signer["before"])
        published = _read_manifest(manifest_path, _shared(cfg))
        if not isinstance(published, dict) or published.get("run_id") != run_id:
            theirs = published.get("run_id") if isinstance(published, dict) else None
            raise ManifestMismatch(f"site {site!r} refuses to start: the run manifest {manifest_path} describes run "
                                   f"{theirs!r}, not {run_id!r} (copied from another run?)")
        own = check_manifest(cfg, published, party=f"site {site!r}",
                             source=f"the aggregator's run manifest {manifest_path}")
        # bound to what this site checked: its own view of the run, equal to the aggregator's
        signer["binding"] = binding = run_binding(run_id, own)
        _check_writable(cfg.run_dir / site, f"site {site!r}'s output folder")
        _check_writable(_party_work(cfg, run_id, site), f"site {site!r}'s working folder")
        keys = signer["keys"] = _party_keys(cfg, folder, site, key_file, keys_file, signer["before"])
        ctx = SiteContext(cfg=cfg, site=site, work=_party_work(cfg, run_id, site), out=cfg.run_dir / site,
                          exchange=_exchange_factory(folder, cfg, keys, binding, progress, signer["before"]),
                          timeout=cfg.timeout,
                          progress=_say if progress else None)
        return run_site_analysis(ctx)

    return _reporting(folder, _shared(cfg), site, run, cfg=cfg, run_id=run_id, key_file=key_file,
                      keys_file=keys_file)
