"""Open a local HTML file in headless Chromium (Debian's package) over the DevTools protocol.

Used by the report test: the page must load with no network access, log no
console errors and show every image. Only 127.0.0.1 is used (the DevTools
port); the browser is killed when the check ends.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-address=127.0.0.1"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inspect_page(html: Path, *, screenshot: Path | None = None, timeout: float = 60.0) -> dict:
    """Load ``html``; return console errors, failed requests and every image's decoded size."""
    from websockets.sync.client import connect

    port = _free_port()
    profile = tempfile.mkdtemp(prefix="chromium-")
    proc = subprocess.Popen([chromium(), *FLAGS, f"--remote-debugging-port={port}", f"--user-data-dir={profile}",
                             "--window-size=1280,2000", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                    pages = [t for t in json.load(r) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not start")
            time.sleep(0.2)
        with connect(pages[0]["webSocketDebuggerUrl"], max_size=2**28, open_timeout=timeout) as ws:
            ids = iter(range(1, 10**6))
            events: list[dict] = []

            def call(method: str, **params):
                i = next(ids)
                ws.send(json.dumps({"id": i, "method": method, "params": params}))
                while True:
                    msg = json.loads(ws.recv(timeout=timeout))
                    if msg.get("id") == i:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg.get("result", {})
                    events.append(msg)

            for domain in ("Page", "Runtime", "Log", "Network"):
                call(f"{domain}.enable")
            call("Page.navigate", url=html.resolve().as_uri())
            while not any(e.get("method") == "Page.loadEventFired" for e in events):
                events.append(json.loads(ws.recv(timeout=timeout)))
            images = call("Runtime.evaluate", returnByValue=True, awaitPromise=True, expression=(
                "Promise.all(Array.from(document.images).map(i => i.decode().then(() => 0, () => 0)))"
                ".then(() => Array.from(document.images).map(i => [i.alt, i.naturalWidth, i.naturalHeight]))"
            ))["result"]["value"]
            frames = call("Runtime.evaluate", returnByValue=True,
                          expression="document.querySelectorAll('iframe').length")["result"]["value"]
            if screenshot is not None:
                import base64

                shot = call("Page.captureScreenshot", format="png", captureBeyondViewport=False)
                Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
            time.sleep(0.5)  # late console messages
            ws.send(json.dumps({"id": 0, "method": "Runtime.evaluate", "params": {"expression": "1"}}))
            try:
                while True:
                    msg = json.loads(ws.recv(timeout=1.0))
                    if msg.get("id") == 0:
                        break
                    events.append(msg)
            except TimeoutError:
                pass
    finally:
        proc.kill()
        proc.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
    errors = [e["params"]["entry"]["text"] for e in events
              if e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error"]
    errors += [" ".join(str(a.get("value", a.get("description", ""))) for a in e["params"]["args"])
               for e in events if e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error"]
    errors += [e["params"]["exceptionDetails"].get("text", "exception") for e in events
               if e.get("method") == "Runtime.exceptionThrown"]
    remote = [e["params"]["request"]["url"] for e in events if e.get("method") == "Network.requestWillBeSent"
              and not e["params"]["request"]["url"].startswith(("file:", "data:", "about:"))]
    return {"errors": errors, "remote_requests": remote, "images": images, "iframes": frames}
