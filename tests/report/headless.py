"""Headless Chromium over the DevTools protocol, standard library only (tests of the HTML report).

Chromium runs with ``--remote-debugging-pipe``: requests go in on its fd 3, answers and
events come out on its fd 4, each a JSON message ending in a NUL byte. The network is off
three ways: a proxy that is nothing (127.0.0.1:9), a host resolver that resolves nothing, and
the protocol's offline emulation; every request the page makes is still recorded
(``Page.requests``), so a test sees an attempt even though it cannot succeed.

    python tests/report/headless.py PAGE.html OUT.png [HEIGHT]   # a screenshot (docs/report.png)
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WIDTH, HEIGHT = 1100, 900


@dataclass
class Page:
    """What loading a page produced: console errors, requests, a screenshot, evaluated values."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    screenshot: bytes = b""
    values: dict[str, Any] = field(default_factory=dict)


class Browser:
    """One headless Chromium; ``load`` opens a page in a fresh tab. Use as a context manager."""

    def __init__(self) -> None:
        if CHROMIUM is None:
            raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
        self._profile = tempfile.TemporaryDirectory(prefix="casckpt-chromium-")
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()

        def pipes() -> None:  # in the child: the protocol's fds 3 and 4
            # dup first: dup2 onto the same number is a no-op that keeps close-on-exec
            a, b = os.dup(to_child), os.dup(from_child)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={self._profile.name}", "--proxy-server=127.0.0.1:9",
             "--host-resolver-rules=MAP * ~NOTFOUND", "--disable-background-networking",
             "--no-first-run", "--hide-scrollbars", f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
            preexec_fn=pipes, close_fds=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._next = 0
        self._events: list[dict[str, Any]] = []

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.call("Browser.close")
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        os.close(self._write)
        os.close(self._read)
        self._profile.cleanup()

    def call(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30) -> dict[str, Any]:
        """Send one request and return its result (events that arrive meanwhile are kept)."""
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        wanted = self._next
        answer = self._until(lambda m: m.get("id") == wanted, timeout)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer["result"]
        return result

    def _until(self, done: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                self._events.append(message)
                if done(message):
                    return dict(message)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self._read], [], [], left)
            if ready:
                chunk = os.read(self._read, 1 << 20)
                if not chunk:
                    raise EOFError("chromium closed the protocol pipe")
                self._buffer += chunk

    def load(self, path: Path, *, dark: bool = False, evaluate: dict[str, str] | None = None,
             width: int = WIDTH) -> Page:
        """Open ``path`` (a file) offline in a window ``width`` CSS pixels wide, wait for its load
        event, run each ``evaluate`` expression (its JSON value lands in ``Page.values``), take a
        full-page screenshot."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=session)
        self.call("Network.emulateNetworkConditions", {"offline": True, "latency": 0,
                  "downloadThroughput": -1, "uploadThroughput": -1}, session=session)
        self.call("Emulation.setEmulatedMedia", {"features": [
            {"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]}, session=session)
        self.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": HEIGHT,
                  "deviceScaleFactor": 1, "mobile": False}, session=session)
        first = len(self._events)
        self.call("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
        self._until(lambda m: m.get("method") == "Page.loadEventFired" and m.get("sessionId") == session, 60)
        page = Page()
        for name, expression in (evaluate or {}).items():
            value = self.call("Runtime.evaluate", {"expression": f"JSON.stringify({expression})",
                                                   "returnByValue": True}, session=session)
            if "exceptionDetails" in value:
                raise RuntimeError(f"{name}: {value['exceptionDetails']}")
            page.values[name] = json.loads(value["result"]["value"])
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                         session=session, timeout=60)
        page.screenshot = base64.b64decode(shot["data"])
        self.call("Target.closeTarget", {"targetId": target})
        for event in self._events[first:]:
            if event.get("sessionId") != session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                page.errors.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Runtime.exceptionThrown":
                page.errors.append(f"exception: {params.get('exceptionDetails')}")
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                page.errors.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
            elif method == "Network.requestWillBeSent":
                page.requests.append(params["request"]["url"])
        return page


if __name__ == "__main__":
    from PIL import Image

    with Browser() as browser:
        loaded = browser.load(Path(sys.argv[1]))
    out = Path(sys.argv[2])
    out.write_bytes(loaded.screenshot)
    if len(sys.argv) > 3:  # keep the top HEIGHT pixels, in 256 colours: small enough to commit
        image = Image.open(out)
        top = image.crop((0, 0, image.width, min(image.height, int(sys.argv[3]))))
        top.quantize(256).save(out, optimize=True)
    print(out, out.stat().st_size)
