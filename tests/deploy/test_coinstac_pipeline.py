"""The COINSTAC computation driven by COINSTAC's own pipeline code (npm coinstac-pipeline 6.9.8).

``coinstac_pipeline/run.js`` does what coinstac-simulator does: an MQTT broker,
a remote and one local pipeline manager per site, containers through
coinstac-container-manager's singularity service. The ``singularity`` it finds
on PATH is a stand-in written here that starts the computation's entry point
as a process (no Docker daemon). Every message and every file therefore moves
as in COINSTAC: JSON through Node.js and MQTT, transfer files through the
pipeline's HTTP file server and its archives.

CI sets DPNEURO_REQUIRE_COINSTAC=1, so a missing Node.js or npm fails there
instead of skipping.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import deploy_common as dc
import numpy as np
import pytest

from dpneuro.deploy import coinstac as dcc
from dpneuro.deploy import coinstac_sim as sim
from dpneuro.report.figures import read_timecourses

HERE = Path(__file__).resolve().parents[1] / "coinstac_pipeline"
COINSTAC = dc.TEMPLATES / "coinstac"
ALLOWED = {"cape-noise", "secagg-mask", "encrypted-share", "secagg-share", "public"}

# what coinstac-container-manager's singularity service runs (services/singularity.js):
#   singularity run --containall --writable-tmpfs -e --env PYTHONUNBUFFERED=1,COINSTAC_PORT=<port>
#       -B <mounts>,/tmp:/tmp:rw <imageDirectory>/<image>
# The stand-in checks that shape and starts the image's command, the entry point, on that port. The service
# exits after its one request: the singularity service starts new containers every iteration and stops them
# only at the end of the run. Each records its pid, so the test stops whatever is left.
STAND_IN = '''#!{python}
import os, sys
open(os.path.join({pids!r}, str(os.getpid())), "w").close()
args = sys.argv[1:]
assert args[0] == "run" and "--containall" in args, args
env = dict(os.environ)
for kv in args[args.index("--env") + 1].split(","):
    k, v = kv.split("=", 1)
    env[k] = v
mounts = args[args.index("-B") + 1].split(",")
assert [m.split(":")[1] for m in mounts[:3]] == ["/input", "/output", "/transfer"], mounts
image = os.path.basename(args[args.index("-B") + 2])
assert image == {image!r}, image
os.execve({python!r}, [{python!r}, "-m", "dpneuro.deploy.coinstac_sim", "serve", {entry!r}, "--max-requests", "1"],
          env)
'''


def _require(what: str) -> None:
    if os.environ.get("DPNEURO_REQUIRE_COINSTAC") == "1":
        pytest.fail(f"{what} is required here (DPNEURO_REQUIRE_COINSTAC=1)")
    pytest.skip(f"{what} is not available")


def coinstac_node_modules() -> Path:
    """COINSTAC's npm packages as pinned by the lock file, installed once per lock into a cache folder."""
    npm = shutil.which("npm")
    if not (shutil.which("node") and npm):
        _require("Node.js with npm")
    lock = (HERE / "package-lock.json").read_bytes()
    cache = Path(os.environ.get("DPNEURO_NODE_CACHE", Path.home() / ".cache" / "dpneuro"))
    target = cache / f"coinstac-pipeline-{hashlib.sha256(lock).hexdigest()[:12]}"
    if (target / "node_modules" / "coinstac-pipeline").is_dir():
        return target / "node_modules"
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=cache, prefix=".install-"))
    try:
        for name in ("package.json", "package-lock.json"):
            shutil.copyfile(HERE / name, work / name)
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=work,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            _require(f"npm ci of COINSTAC's packages ({proc.stderr.strip()[-500:]})")
        try:
            work.rename(target)
        except OSError:  # another process installed it meanwhile
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target / "node_modules"


def _running(pids: Path) -> list[int]:
    """The services the stand-in started that still run."""
    out = []
    for f in pids.iterdir():
        try:
            with open(f"/proc/{f.name}/cmdline", "rb") as c:
                if b"coinstac_sim" in c.read():  # not a zombie, not a reused pid
                    out.append(int(f.name))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def _stop_all(pids: Path) -> None:
    for pid in _running(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _state_dirs(root: Path, clients: list[str]) -> list[Path]:
    """The parties' private folders: COINSTAC's pipeline gives every container cacheDirectory /tmp."""
    out = []
    for role, cid in [("site", c) for c in clients] + [("remote", "remote")]:
        base = root / "input" / cid / sim.RUN
        out.append(dcc._state_dir({"cacheDirectory": "/tmp", "clientId": cid, "baseDirectory": str(base)},
                                  role))
    return out


@pytest.mark.slow  # a few minutes: installs COINSTAC's packages once, then 4 sites (CI runs it)
def test_coinstac_pipeline_runs_the_computation_like_the_simulation(tmp_path):
    pytest.importorskip("coinstac")
    modules = coinstac_node_modules()

    # 3 ICA rounds: the singularity service starts new containers every iteration (~7 s each here)
    # temporal ICA: the run follows capeDJICA's private rounds through COINSTAC's iterations
    spec = [{**site, "ica": {"value": "temporal"}, "ica_rounds": {"value": 3}}
            for site in json.loads((COINSTAC / "inputspec.json").read_text())]
    (tmp_path / "inputspec.json").write_text(json.dumps(spec))
    compspec = json.loads((COINSTAC / "compspec.json").read_text())
    man = dc.consortium(tmp_path / "data", n_timepoints=60)
    root = tmp_path / "sim"
    clients = sim.prepare_inputs(root, [[x["path"] for x in s["subjects"]] for s in man["sites"]])
    settings = dcc.settings_from_inputs(spec[0])
    ref = dc.reference(dc.run_config(man, tmp_path / "ref", **settings))

    image = compspec["computation"]["dockerImage"].replace("/", "_")  # how the service names a local image
    images, bin_dir = tmp_path / "images", tmp_path / "bin"
    images.mkdir()
    bin_dir.mkdir()
    (images / f"{image}-sha256").write_bytes(b"")
    stand_in = bin_dir / "singularity"
    pids = tmp_path / "pids"
    pids.mkdir()
    stand_in.write_text(STAND_IN.format(python=sys.executable, image=f"{image}-sha256", pids=str(pids),
                                        entry=str(COINSTAC / "entry.py")))
    stand_in.chmod(0o755)

    job = {"compspec": str(COINSTAC / "compspec.json"), "inputspec": str(tmp_path / "inputspec.json"),
           "directory": str(root), "imageDirectory": str(images), "timeoutSeconds": 600,
           "result": str(tmp_path / "result.json"), "logLevel": "info"}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NODE_PATH": str(modules),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    log = tmp_path / "pipeline.log"
    states = _state_dirs(root, clients)
    try:
        with open(log, "wb") as out:
            proc = subprocess.run([shutil.which("node"), str(HERE / "run.js"), str(tmp_path / "job.json")],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, timeout=700)
        result = json.loads((tmp_path / "result.json").read_text())
        assert proc.returncode == 0 and result["ok"], \
            f"{result.get('error')}\n--- pipeline log ---\n{log.read_text(errors='replace')[-4000:]}"

        output = result["remote"]  # the remote's final output, as COINSTAC gives it to the consortium
        out = root / "output" / "remote" / sim.RUN
        assert output["ica_rounds"] == settings["ica_rounds"] == ref["rounds"]
        np.testing.assert_array_equal(np.load(out / output["W"]), ref["W"])
        np.testing.assert_allclose(np.load(out / output["basis"]), ref["basis"], rtol=1e-9, atol=1e-12)
        priv = json.loads((out / output["privacy"]).read_text())
        for i, cid in enumerate(clients):
            assert dc.same_releases(priv["sites"][cid]["ledger"], ref["ledgers"][f"site-{i + 1:02d}"]), cid
            site_out = root / "output" / cid / sim.RUN
            subjects, tc = read_timecourses(site_out / "timecourses.tsv")
            assert tc.shape == (4, 3 * 60) and len(set(subjects)) == 3
            assert (site_out / "report.html").exists() and (site_out / "privacy.json").exists()
            logs = list(states[i].rglob("egress/site-*.jsonl"))
            # the releases, the unmixing the FNC's time courses need, and the closing summary
            assert sorted(log.parent.parent.name for log in logs) == ["fnc", "fnc-reads", "reduce", "summary", "unmix"]
            for path in logs:
                for rec in map(json.loads, path.read_text().splitlines()):
                    assert all(a["carries"] in ALLOWED for a in rec["arrays"].values()), rec
        assert (out / output["report"]).exists() and (out / output["components"]).exists()
        assert result["iterations"] >= 1 + settings["ica_rounds"]
        print(f"\nCOINSTAC pipeline run: {result['iterations']} iterations, {result['seconds']:.1f} s wall "
              f"(Node {subprocess.run(['node', '--version'], capture_output=True, text=True).stdout.strip()})")
        # every container served its one request and exited (none left running)
        deadline = time.monotonic() + 10
        while _running(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _running(pids) == [], "services still running after the run"
        containers = len(list(pids.iterdir()))
        print(f"\n{containers} containers started")
    finally:
        _stop_all(pids)
        for d in states:
            shutil.rmtree(d, ignore_errors=True)
