"""Headless Chromium over the DevTools protocol on a pipe (`--remote-debugging-pipe`: fd 3 in,
fd 4 out, NUL-terminated JSON), standard library only. One browser renders several pages; for
each it records the DOM, a full-page screenshot, console errors, exceptions, log errors (a
blocked load, a CSP violation) and every network request the page made."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

LAYOUT = r"""(() => {
  const doc = document.documentElement;
  const overlaps = [];
  for (const svg of document.querySelectorAll('svg')) {
    const boxes = [...svg.querySelectorAll('text')]
      .filter(t => !t.closest('g.mark'))
      .map(t => [t.textContent, t.getBoundingClientRect()]);
    for (let i = 0; i < boxes.length; i++)
      for (let j = i + 1; j < boxes.length; j++) {
        const [a, b] = [boxes[i][1], boxes[j][1]];
        if (a.left < b.right - 0.5 && b.left < a.right - 0.5 &&
            a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5)
          overlaps.push([svg.id, boxes[i][0], boxes[j][0]]);
      }
  }
  return {scroll_width: doc.scrollWidth, client_width: doc.clientWidth, overlaps};
})()"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Rendered:
    url: str
    dom: str = ""
    png: bytes = b""
    console_errors: list = field(default_factory=list)
    log_errors: list = field(default_factory=list)
    requests: list = field(default_factory=list)
    # What a person would see go wrong in the layout: the page's width against the window's,
    # and every pair of chart labels (SVG text, outside the marks) whose boxes overlap.
    layout: dict = field(default_factory=dict)

    def foreign_requests(self) -> list:
        """Requests for anything but the page itself (its own file:// load is the only one)."""
        return [u for u in self.requests if u != self.url]


class Browser:
    # A hang guard, not a timing check: a cold chromium on a loaded 2-core machine took more
    # than 30 s to answer its first call (every page test then errored).
    def __init__(self, exe: str, timeout: float = 120.0):
        self.timeout = timeout
        to_browser_r, self._w = os.pipe()
        self._r, from_browser_w = os.pipe()

        def fds():
            # Above 9 first, so neither dup2 overwrites the other pipe when it sits at 3 or 4.
            r, w = (
                fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10),
                fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10),
            )
            os.dup2(r, 3)
            os.dup2(w, 4)

        # No network: every http(s) request goes to a proxy that is not there (and is
        # recorded first by Network.requestWillBeSent).
        args = [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-pipe",
            "--proxy-server=127.0.0.1:9",
            "--proxy-bypass-list=<-loopback>",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-sync",
            "--disable-component-update",
            "--disable-default-apps",
            "--hide-scrollbars",
            "--window-size=1280,900",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            args,
            preexec_fn=fds,
            pass_fds=(3, 4),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._id = 0
        self.events: list = []
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Network", "Log"):
            self.call(f"{domain}.enable", session=True)

    def _send(self, msg: dict) -> None:
        os.write(self._w, json.dumps(msg).encode() + b"\0")

    def _next(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit {self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self._send(msg)
        while True:
            m = self._next()
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def _wait_event(self, method: str) -> dict:
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        while True:
            m = self._next()
            if m.get("method") == method:
                return m
            self.events.append(m)

    def render(self, path: Path) -> Rendered:
        url = Path(path).resolve().as_uri()
        out = Rendered(url)
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self._wait_event("Page.loadEventFired")
        # A round trip after the load: events the page raised while loading have arrived.
        dom = self.call(
            "Runtime.evaluate",
            session=True,
            expression="document.documentElement.outerHTML",
            returnByValue=True,
        )
        out.dom = dom["result"]["value"]
        out.layout = self.call(
            "Runtime.evaluate", session=True, expression=LAYOUT, returnByValue=True
        )["result"]["value"]
        size = self.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
        shot = self.call(
            "Page.captureScreenshot",
            session=True,
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        out.png = base64.b64decode(shot["data"])
        for e in self.events:
            p = e.get("params", {})
            match e.get("method"):
                case "Runtime.consoleAPICalled" if p.get("type") in ("error", "assert", "warning"):
                    out.console_errors.append(
                        " ".join(
                            str(a.get("value", a.get("description"))) for a in p.get("args", [])
                        )
                    )
                case "Runtime.exceptionThrown":
                    out.console_errors.append(p["exceptionDetails"].get("text", "exception"))
                case "Log.entryAdded" if p["entry"]["level"] in ("error", "warning"):
                    out.log_errors.append(p["entry"]["text"])
                case "Network.requestWillBeSent":
                    out.requests.append(p["request"]["url"])
        return out

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)
