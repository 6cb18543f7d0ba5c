"""``dpneuro site`` / ``dpneuro aggregator``: one role of a run per process, over a shared folder.

A consortium without COINSTAC runs the analysis across machines that mount
one shared folder (``exchange_dir`` in the configuration: NFS, SMB, a synced
cloud folder with atomic renames). Layout of a run::

    <exchange_dir>/<run_id>/manifest.json     the run manifest (written by the aggregator)
    <exchange_dir>/<run_id>/run.key           the run's message key (0600), unless --key-file is used
    <exchange_dir>/<run_id>/reduce/...        capePCA messages (DirectoryExchange)
    <exchange_dir>/<run_id>/unmix/...         capeDJICA messages
    <exchange_dir>/<run_id>/summary/...       ledgers in, reported unmixing out
    <exchange_dir>/<run_id>/failed/<party>-<hash>.json  a party that stopped with an error, and why

Trust assumptions. Messages are authenticated with an HMAC key per run.
By default the aggregator writes it to ``run.key`` with permissions 0600, so
whoever can read that file (the account(s) that run the parties, and the
file server's administrators) could forge messages: use it when the shared
folder is reachable only by the consortium's service account. Otherwise
hand out a key file out of band (``--key-file`` on every party; 32 random
bytes, hex) and nothing secret lies in the shared folder. What is *in* the
messages is protected regardless of who reads the folder: only CAPE-noised
or secure-aggregation-masked arrays and public metadata leave a site; the
key only guards integrity.

Outputs go to ``<out>/<run_id>/`` (the aggregator's: maps, privacy.json,
report.html) and ``<out>/<run_id>/<site>/`` (a site's own), so a run with
another id never overwrites an earlier run's; the default run id is
``dpneuro`` (:data:`~dpneuro.config.DEFAULT_RUN_ID`, or the configuration's
``run_id``). Each party keeps its own progress under ``<out>/.dpneuro/<run_id>/<party>/``
(checkpoints and intermediate results; a site's hold un-noised statistics of
its data, so this folder stays private); a new run id starts afresh. A party
that fails leaves a notice in ``<exchange_dir>/<run_id>/failed/`` so that the
others stop at once with its name and error. A killed party restarted with the same command
resumes where it stopped: it re-sends the message it had written ahead
instead of computing it again, so nothing is ever released twice.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..config import DEFAULT_RUN_ID, ConfigError, RunConfig
from ..exchange import DirectoryExchange, PartyFailed
from ..exchange.codec import check_name
from ..exchange.directory import check_failure_notices, clear_failure_notice, write_failure_notice
from ..driver import RunOptions
from .party import (
    AggregatorContext,
    ManifestMismatch,
    SiteContext,
    check_manifest,
    run_aggregator_analysis,
    run_manifest,
    run_site_analysis,
)

__all__ = ["DEFAULT_RUN_ID", "WaitTimeout", "aggregator_main", "load_party_config", "run_folder", "site_main"]

_POLL = 0.05


class WaitTimeout(RuntimeError):
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


def _read_key_file(path) -> bytes:
    text = Path(path).read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"key file {path}: expected hex digits (e.g. 64 for a 32-byte key)") from None
    if len(key) < 16:
        raise ConfigError(f"key file {path}: the key must be at least 16 bytes (32 hex digits)")
    return key


def _create_key(path: Path) -> bytes:
    """The run key at ``path``: created (0600) if absent, else read.

    Written to a private temporary file and hard-linked into place, so a site
    never reads a half-written key and two aggregators cannot both create one.
    """
    if path.exists():
        return _read_key_file(path)
    tmp = path.with_name(f".run.key.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_bytes(32).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another aggregator process won the race: use its key
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key_file(path)


def _wait_for(path: Path, timeout: float | None, what: str, folder: Path, me: str) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    if not path.exists():  # a site started before its aggregator says what it waits for, once
        limit = "without a time limit" if timeout is None else f"for up to {timeout:g} s"
        print(f"{me}: waiting {limit} for {what} ({path}): start `dpneuro aggregator` with the same "
              "exchange_dir and run id", file=sys.stderr, flush=True)
    while not path.exists():
        check_failure_notices(folder, me)
        if deadline is not None and time.monotonic() >= deadline:
            raise WaitTimeout(f"waited {timeout} s for {what} ({path}); is the aggregator running with the "
                               "same exchange_dir and run id?")
        time.sleep(_POLL)


def _publish_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest once; an existing one must be this run's (a restarted aggregator)."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    tmp = path.with_name(f".manifest.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)  # atomic create-if-absent
    except FileExistsError:
        old = json.loads(path.read_text())
        if old != json.loads(text):
            raise ManifestMismatch(
                f"{path} already describes a run with different settings; this aggregator refuses to "
                f"continue it (use another --run-id, or remove {path.parent} to start over)") from None
    finally:
        tmp.unlink(missing_ok=True)


def _exchange_factory(folder: Path, cfg: RunConfig, key: bytes):
    names = [s.name for s in cfg.sites]
    try:
        [check_name("site name", n) for n in names]
    except ValueError:
        names = None  # names that cannot be file names: the exchange numbers the sites instead

    def make(stage: str) -> DirectoryExchange:
        return DirectoryExchange(folder, len(cfg.sites), run_id=stage, key=key, site_names=names)

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


def _reporting(folder: Path, party: str, run):
    """Run ``run()``; if it fails, leave a notice so that the other parties stop at once, naming ``party``."""
    folder.mkdir(parents=True, exist_ok=True)
    clear_failure_notice(folder, party)  # a restarted party is alive again
    try:
        return run()
    except PartyFailed:
        raise  # another party's failure: it left its own notice
    except BaseException as exc:
        write_failure_notice(folder, party, str(exc) if isinstance(exc, ValueError)
                             else f"{type(exc).__name__}: {exc}")
        raise


def aggregator_main(cfg: RunConfig, *, run_id: str | None = None, key_file=None,
                    progress: bool = False) -> dict[str, Any]:
    """Run the aggregator of ``cfg`` over ``exchange_dir``; write the consortium outputs to ``<cfg.out>/<run_id>/``.

    ``run_id``: default the configuration's. Writes the run manifest and
    (without ``key_file``) the run key first, then waits for the sites; every
    wait is bounded by ``cfg.timeout``, and a site that fails ends the wait at
    once with its name and error.
    """
    cfg, run_id = _with_run_id(cfg, run_id)
    folder = run_folder(cfg, run_id)

    def run() -> dict[str, Any]:
        key = _read_key_file(key_file) if key_file else _create_key(folder / "run.key")
        _publish_manifest(folder / "manifest.json", run_manifest(cfg, run_id))
        out = cfg.run_dir
        transport = ("Messages are authenticated with the run's HMAC key " + (
            "handed out of band (--key-file): only its holders can forge them." if key_file else
            f"in {folder / 'run.key'} (0600): whoever can read that file could forge messages (change the "
            "broadcast basis or unmixing, or stop the run), but not learn more than the noised releases allow."))
        ctx = AggregatorContext(cfg=cfg, work=_party_work(cfg, run_id, "aggregator"), out=out,
                                exchange=_exchange_factory(folder, cfg, key),
                                options=RunOptions(timeout=cfg.timeout, progress=progress), transport=transport)
        return run_aggregator_analysis(ctx)

    return _reporting(folder, "aggregator", run)


def site_main(cfg: RunConfig, site: str, *, run_id: str | None = None, key_file=None) -> dict[str, Any]:
    """Run site ``site`` of ``cfg`` over ``exchange_dir``; its outputs go to ``<cfg.out>/<run_id>/<site>/``.

    ``run_id``: default the configuration's.

    Refuses to start (:class:`~dpneuro.deploy.party.ManifestMismatch`, naming
    the field) if its configuration disagrees with the aggregator's manifest.
    If it fails (bad data, a crash), it leaves a notice in the shared folder so
    that the aggregator and the other sites stop within seconds, naming it.
    """
    cfg, run_id = _with_run_id(cfg, run_id)
    folder = run_folder(cfg, run_id)

    def run() -> dict[str, Any]:
        manifest_path = folder / "manifest.json"
        _wait_for(manifest_path, cfg.timeout, "the aggregator's run manifest", folder, site)
        check_manifest(cfg, json.loads(manifest_path.read_text()), party=f"site {site!r}",
                       source=f"the aggregator's run manifest {manifest_path}")
        if key_file:
            key = _read_key_file(key_file)
        else:
            _wait_for(folder / "run.key", cfg.timeout, "the run key", folder, site)
            key = _read_key_file(folder / "run.key")
        ctx = SiteContext(cfg=cfg, site=site, work=_party_work(cfg, run_id, site), out=cfg.run_dir / site,
                          exchange=_exchange_factory(folder, cfg, key), timeout=cfg.timeout)
        return run_site_analysis(ctx)

    return _reporting(folder, site, run)
