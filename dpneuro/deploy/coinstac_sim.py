"""Run a COINSTAC computation locally, following COINSTAC's message flow (no Docker, no COINSTAC client).

The computation itself runs in real ``coinstac`` websocket services (the
entry point's ``coinstac.start(local, remote)``, PyPI ``coinstac``), started
as subprocesses bound to 127.0.0.1. The driver plays COINSTAC's pipeline
manager for compspec version 2 (``coinstac-pipeline``'s service function):

- per iteration, every site gets ``{"mode": "local", "data": {"input",
  "cache", "state"}}`` on a fresh websocket (concurrently); the first input
  is the site's inputspec values, later ones the remote's last output;
  ``state`` has ``baseDirectory``, ``outputDirectory``, ``cacheDirectory``,
  ``transferDirectory``, ``clientId`` and ``iteration``; the reply is
  ``{"type": "stdout", "data": {"output", "cache"}}`` (or ``"stderr"``
  with a traceback); a returned cache is merged into the site's cache;
- files each site wrote to its transfer directory move to the remote's
  ``baseDirectory/<clientId>/``;
- the remote gets ``{"mode": "remote", "data": {"input": {clientId:
  output}, ...}}``; the files it wrote move to every site's base directory;
- the run ends when the remote's reply has ``"success": true``.

Folders follow the COINSTAC simulator's layout under ``root``:
``input|output|transfer|cache/<clientId>/<run>``. Every wait is bounded.

``python -m dpneuro.deploy.coinstac_sim serve ENTRY`` runs an entry point
with ``coinstac.start`` bound to 127.0.0.1 instead of 0.0.0.0 (port from
``COINSTAC_PORT``, as in COINSTAC).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpneuro._utils.errors import DpneuroError

__all__ = [
    "CoinstacService",
    "ComputationError",
    "ServiceError",
    "SimulationRun",
    "free_port",
    "node_json_roundtrip",
    "prepare_inputs",
    "run_computation",
]

RUN = "simulatorRun"


class ServiceError(DpneuroError, RuntimeError):
    """A service did not start, answered nonsense, or a wait ran out of time."""


class ComputationError(DpneuroError, RuntimeError):
    """The computation raised: the service replied on stderr (the message is its traceback)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CoinstacService:
    """One ``coinstac.start`` websocket service (a subprocess), listening on 127.0.0.1 only.

    Parameters
    ----------
    entry : path
        The computation's entry point (calls ``coinstac.start(local, remote)``).
    port : int, optional
        Default: a free port.
    log : path, optional
        Where the service's stdout/stderr go (default: discarded).
    start_timeout : float
        Seconds to wait for the port to accept connections.
    max_requests : int, optional
        Exit after answering that many requests (a container COINSTAC starts for one iteration).
    """

    def __init__(self, entry, *, port: int | None = None, log=None, env: Mapping[str, str] | None = None,
                 start_timeout: float = 60.0, max_requests: int | None = None):
        self.entry = Path(entry)
        self.port = port or free_port()
        self.log = Path(log) if log else None
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.max_requests = max_requests
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def start(self) -> CoinstacService:
        """Launch the service and wait until it listens."""
        return self.launch().wait_ready()

    def launch(self) -> CoinstacService:
        """Start the process without waiting (several services then start in parallel)."""
        env = {**os.environ, **self.env, "COINSTAC_PORT": str(self.port), "PYTHONUNBUFFERED": "1"}
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        try:
            limit = ["--max-requests", str(self.max_requests)] if self.max_requests else []
            self.proc = subprocess.Popen([sys.executable, "-m", "dpneuro.deploy.coinstac_sim", "serve",
                                          str(self.entry), *limit], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        return self

    def wait_ready(self) -> CoinstacService:
        """Wait (at most ``start_timeout`` s) until the port accepts connections."""
        if self.proc is None:
            raise ServiceError("the service was not launched")
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServiceError(f"the service for {self.entry} exited with code {self.proc.returncode}"
                                   + self._log_tail())
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"the service did not listen on port {self.port} within "
                                   f"{self.start_timeout} s" + self._log_tail())
            time.sleep(0.05)

    def _log_tail(self) -> str:
        if self.log and self.log.exists():
            return "\n--- service log ---\n" + self.log.read_text(errors="replace")[-3000:]
        return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the service (kill it if it does not exit within ``timeout``)."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout)

    def __enter__(self) -> CoinstacService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


async def _call(url: str, mode: str, data: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request as COINSTAC's pipeline sends it (compspec v2) and the reply's ``data``."""
    import websockets  # deferred: an optional extra (coinstac)

    try:
        async with websockets.connect(url, open_timeout=timeout, close_timeout=5, max_size=2**30) as ws:
            await ws.send(json.dumps({"mode": mode, "data": data}))
            raw = await asyncio.wait_for(ws.recv(), timeout)
    except (asyncio.TimeoutError, TimeoutError):
        raise ServiceError(f"no reply from {url} ({mode}) within {timeout} s") from None
    res = json.loads(raw)
    if res.get("type") == "stdout":
        return res.get("data") or {}
    if res.get("type") == "stderr":
        raise ComputationError(f"{mode} computation failed:\n{res.get('data')}")
    raise ServiceError(f"unexpected reply from {url}: {str(res)[:300]}")


def _dirs(root: Path, cid: str) -> dict[str, str]:
    d = {k: root / k / cid / RUN for k in ("input", "output", "transfer", "cache")}
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True)
    return {"baseDirectory": str(d["input"]), "outputDirectory": str(d["output"]),
            "cacheDirectory": str(d["cache"]), "transferDirectory": str(d["transfer"])}


def _move_all(src: Path, dests: Sequence[Path], drop: Callable[[str], bool] | None = None) -> int:
    """Move every file of ``src`` to each of ``dests`` (copy to all, then remove); returns the count.

    ``drop(name)`` True loses that file on the way (tests: COINSTAC losing a transfer).
    """
    n = 0
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        if drop is not None and drop(f.name):
            f.unlink()
            continue
        for d in dests:
            d.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, d / f.name)
        f.unlink()
        n += 1
    return n


def prepare_inputs(root, site_files: Sequence[Sequence[str | os.PathLike]]) -> list[str]:
    """Copy each site's files into its simulator input folder; returns the client ids (``local0``, ...)."""
    root = Path(root)
    ids = []
    for i, files in enumerate(site_files):
        cid = f"local{i}"
        base = Path(_dirs(root, cid)["baseDirectory"])
        for f in files:
            shutil.copyfile(f, base / Path(f).name)
        ids.append(cid)
    return ids


@dataclass
class SimulationRun:
    """What a driven run returned: the remote's final output and how it went."""

    output: dict[str, Any]
    iterations: int
    seconds: float
    root: Path
    clients: list[str]
    messages: int = 0  # files moved between parties
    site_outputs: dict[str, list[dict]] = field(default_factory=dict)  # every local output, per iteration

    def output_dir(self, cid: str) -> Path:
        return self.root / "output" / cid / RUN


_NODE_LOOP = ("const rl=require('readline').createInterface({input:process.stdin});"
              "rl.on('line',l=>process.stdout.write(JSON.stringify(JSON.parse(l))+'\\n'));")


class NodeJSON:
    """One Node.js process that gives back every JSON value after JSON.parse / JSON.stringify.

    That is what COINSTAC does to every message between the parties: Node
    writes integral floats as integers (20.0 -> 20) and -0.0 as 0; a
    computation must give the same results after it. Callable; close() ends it.
    """

    def __init__(self) -> None:
        node = shutil.which("node")
        if node is None:
            raise ServiceError("Node.js (node) is needed to carry messages as COINSTAC does")
        self._proc = subprocess.Popen([node, "-e", _NODE_LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True, encoding="utf-8")

    def __call__(self, obj: Any) -> Any:
        self._proc.stdin.write(json.dumps(obj) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise ServiceError("the Node.js JSON process stopped")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)


def node_json_roundtrip(obj: Any) -> Any:
    """``obj`` after one JSON.parse / JSON.stringify in Node.js (see :class:`NodeJSON`)."""
    node = NodeJSON()
    try:
        return node(obj)
    finally:
        node.close()


def run_computation(inputspec: Sequence[Mapping[str, Any]], root, *, local_url: str | Mapping[str, str],
                    remote_url: str, call_timeout: float = 300.0, deadline: float = 3600.0,
                    max_iterations: int = 100_000,
                    between_iterations: Callable[[int], None] | None = None,
                    carry: Callable[[Any], Any] | None | str = "node",
                    drop: Callable[[int, str, str], bool] | None = None) -> SimulationRun:
    """Drive a decentralized computation to its end (see the module notes).

    Parameters
    ----------
    inputspec : list of dict
        One ``{"var": {"value": ...}}`` per site (as in ``inputspec.json``);
        site i is client ``local<i>``, whose files must already be in its input
        folder (:func:`prepare_inputs`).
    root : path
        The simulator folder.
    local_url : str or mapping
        The sites' service (one for all, or one per client id).
    remote_url : str
        The remote's service.
    call_timeout, deadline : float
        Seconds per request, and for the whole run.
    between_iterations : callable, optional
        Called with the iteration number after each full iteration (for
        tests: e.g. restart the services mid-run).
    carry : "node", callable or None
        What happens to the JSON between the parties: "node" (default) a round
        trip through Node.js (:class:`NodeJSON`), as in COINSTAC; None passes
        it through Python only.
    drop : callable, optional
        ``drop(iteration, party, file_name)`` True loses that transfer file
        (tests of COINSTAC losing a message).
    """
    node = NodeJSON() if carry == "node" else None
    try:
        return _drive(inputspec, Path(root), local_url, remote_url, call_timeout, deadline, max_iterations,
                      between_iterations, node or carry or (lambda x: x), drop)
    finally:
        if node is not None:
            node.close()


def _drive(inputspec, root: Path, local_url, remote_url, call_timeout: float, deadline: float, max_iterations: int,
           between_iterations, carry: Callable[[Any], Any], drop) -> SimulationRun:
    clients = [f"local{i}" for i in range(len(inputspec))]
    urls = {c: local_url if isinstance(local_url, str) else local_url[c] for c in clients}
    # COINSTAC passes each input's value (coinstac-pipeline: output[key] = val.value)
    inputs = {c: {k: (v["value"] if isinstance(v, Mapping) and "value" in v else v) for k, v in spec.items()}
              for c, spec in zip(clients, inputspec)}
    inputs = carry(inputs)
    dirs = {c: _dirs(root, c) for c in clients + ["remote"]}
    caches: dict[str, dict] = {c: {} for c in clients + ["remote"]}
    t0 = time.monotonic()
    moved, history = 0, {c: [] for c in clients}

    async def iterate(it: int) -> dict[str, Any]:
        nonlocal inputs, moved
        states = {c: {**dirs[c], "clientId": c, "iteration": it} for c in clients + ["remote"]}
        replies = await asyncio.gather(*[
            _call(urls[c], "local", {"input": inputs[c], "cache": caches[c], "state": states[c]}, call_timeout)
            for c in clients])
        outs = {}
        for c, r in zip(clients, replies):
            caches[c].update(carry(r.get("cache") or {}))
            outs[c] = r.get("output")
            history[c].append(outs[c])
            moved += _move_all(Path(dirs[c]["transferDirectory"]), [Path(dirs["remote"]["baseDirectory"]) / c],
                               None if drop is None else (lambda name, c=c: drop(it, c, name)))
        r = await _call(remote_url, "remote", {"input": carry(outs), "cache": caches["remote"],
                                               "state": states["remote"]}, call_timeout)
        caches["remote"].update(carry(r.get("cache") or {}))
        moved += _move_all(Path(dirs["remote"]["transferDirectory"]),
                           [Path(dirs[c]["baseDirectory"]) for c in clients],
                           None if drop is None else (lambda name: drop(it, "remote", name)))
        output = carry(r.get("output"))  # the same JSON goes to every site
        inputs = {c: output for c in clients}
        return r

    for it in range(1, max_iterations + 1):
        if time.monotonic() - t0 > deadline:
            raise ServiceError(f"the run did not finish within {deadline} s ({it - 1} iterations)")
        r = asyncio.run(iterate(it))
        if r.get("success"):
            return SimulationRun(r.get("output") or {}, it, time.monotonic() - t0, root, clients, moved, history)
        if between_iterations is not None:
            between_iterations(it)
    raise ServiceError(f"the run did not finish within {max_iterations} iterations")


# -- `python -m dpneuro.deploy.coinstac_sim serve ENTRY` ---------------------------------------

def _serve(entry: str, host: str, max_requests: int | None = None) -> None:
    """Run ``entry`` (which calls ``coinstac.start``) with its websocket server bound to ``host``.

    ``max_requests``: exit after answering that many requests, as a container
    that COINSTAC's Singularity service starts for one iteration and never
    calls again (connections closed before a request do not count).
    """
    import websockets  # deferred: an optional extra (coinstac)

    real = websockets.serve

    def serve(handler, _host, port, **kw):  # coinstac.start hard-codes 0.0.0.0
        if max_requests:
            served = 0

            async def counted(ws, path):  # websockets passes path only to a two-argument handler
                recv, last = ws.recv, False

                async def request():  # a bare test connection closes before sending one
                    nonlocal served, last
                    msg = await recv()
                    served += 1
                    if served >= max_requests:
                        # Stop listening at once: COINSTAC's port scan probes this port for the next container,
                        # and a listener left open while the process exits resets the probe, failing the run.
                        ws.ws_server.server.close()
                        last = True
                    return msg

                ws.recv = request
                try:
                    await handler(ws, path)
                finally:
                    if last:
                        await ws.close()  # the reply's close handshake
                        asyncio.get_event_loop().stop()

            return real(counted, host, int(port), **kw)
        return real(handler, host, int(port), **kw)

    websockets.serve = serve
    runpy.run_path(entry, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dpneuro.deploy.coinstac_sim")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run a COINSTAC entry point bound to one host (default 127.0.0.1)")
    s.add_argument("entry")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--max-requests", type=int, default=None,
                   help="exit after answering this many requests (a container used for one iteration)")
    a = ap.parse_args(argv)
    _serve(a.entry, a.host, a.max_requests)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
