"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for the web view's
tests: no Playwright, no driver binary. Chromium starts in its own session with
`--remote-debugging-port=0` and a fresh profile under the test's tmp dir; the port is read from
`<profile>/DevToolsActivePort`, and CDP JSON goes over one WebSocket (wsproto, which hypercorn
brings) to the browser endpoint, with a flat session per page. `close()` ends Chromium and kills
its whole process group and whatever names its profile or home (the crash handler, which starts
a session of its own), so no renderer or helper outlives the test.

The flags keep Chromium off the network (this machine's network is closed; without them it
hangs or retries): no background networking, component updates, sync or QUIC.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from harness import kill_matching, pids_alive, process_group, wait_until

__all__ = ["find_chromium", "Browser", "Page", "CdpError"]

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--no-default-browser-check", "--window-size=1280,900",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


def find_chromium() -> str | None:
    """Debian's chromium (or chromium-browser), else None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class CdpError(RuntimeError):
    """A DevTools command answered with an error, or a page-side exception."""


class Browser:
    """One headless Chromium with a fresh profile in `workdir`."""

    def __init__(self, executable: str, workdir: Path, *, timeout: float = 30.0) -> None:
        self.profile, self.home = workdir / "chromium-profile", workdir / "chromium-home"
        self.profile.mkdir(parents=True)
        self.home.mkdir()
        self.log = workdir / "chromium.log"
        # Nothing lands in the user's home: not the cache, not the crash handler's database.
        # (That handler runs in a session of its own; `close` finds it by this home.
        # --disable-crashpad-for-testing would keep it away, but breaks the network service.)
        env = {**os.environ, "HOME": str(self.home), "XDG_CACHE_HOME": str(self.home / ".cache"),
               "XDG_CONFIG_HOME": str(self.home / ".config")}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [executable, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._next = 0
        self.events: list[dict[str, Any]] = []
        try:
            port_file = self.profile / "DevToolsActivePort"
            wait_until(lambda: self._ready(port_file), timeout, message="DevToolsActivePort")
            port, path = port_file.read_text().split()[:2]
            self._connect(int(port), path)
        except BaseException:
            self.close()
            raise

    def _ready(self, port_file: Path) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"chromium exited ({self.proc.returncode}): "
                               f"{self.log.read_text(errors='replace')[-2000:]}")
        return port_file.exists() and len(port_file.read_text().split()) >= 2

    def _connect(self, port: int, path: str) -> None:
        from wsproto import ConnectionType, WSConnection
        from wsproto.events import AcceptConnection, Request
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=self.timeout)
        self._ws = WSConnection(ConnectionType.CLIENT)
        self._sock.sendall(self._ws.send(Request(host=f"127.0.0.1:{port}", target=path)))
        self._text: list[str] = []
        self._frames: list[dict[str, Any]] = []
        while not any(isinstance(e, AcceptConnection) for e in self._pump()):
            pass

    def _pump(self) -> list[Any]:
        """Read once from the socket; complete JSON messages land in `_frames`."""
        from wsproto.events import TextMessage
        assert self._sock is not None
        chunk = self._sock.recv(1 << 20)
        if not chunk:
            raise CdpError("chromium closed the DevTools connection")
        self._ws.receive_data(chunk)
        events = list(self._ws.events())
        for event in events:
            if isinstance(event, TextMessage):
                self._text.append(event.data)
                if event.message_finished:
                    self._frames.append(json.loads("".join(self._text)))
                    self._text.clear()
        return events

    def call(self, method: str, params: dict[str, Any] | None = None, *,
             session: str | None = None) -> dict[str, Any]:
        """One CDP command; events read meanwhile are kept in `events`."""
        from wsproto.events import TextMessage
        assert self._sock is not None
        self._next += 1
        frame: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session is not None:
            frame["sessionId"] = session
        self._sock.sendall(self._ws.send(TextMessage(data=json.dumps(frame))))
        while True:
            while self._frames:
                got = self._frames.pop(0)
                if got.get("id") == self._next:
                    if "error" in got:
                        raise CdpError(f"{method}: {got['error']}")
                    return dict(got.get("result") or {})
                if "method" in got:
                    self.events.append(got)
            self._pump()

    def wait_event(self, method: str, *, session: str | None, after: int) -> dict[str, Any]:
        """The first event `method` of `session` kept after `events[after]`, read if need be."""
        while True:
            for event in self.events[after:]:
                if event["method"] == method and event.get("sessionId") == session:
                    return event
            after = len(self.events)
            while not self._frames:
                self._pump()
            while self._frames:
                got = self._frames.pop(0)
                if "method" in got:
                    self.events.append(got)

    def new_page(self) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        return Page(self, session["sessionId"])

    def close(self) -> None:
        """Ask Chromium to quit, then kill its process group and anything else naming its
        profile or home, whatever it did."""
        group = process_group(self.proc.pid) if self.proc.poll() is None else None
        if self._sock is not None:
            with contextlib.suppress(Exception):
                self.call("Browser.close")
            self._sock.close()
            self._sock = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        members = [p for p in _pids() if group is not None and process_group(p) == group]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        wait_until(lambda: not pids_alive(members), 10, message="chromium's processes gone")
        for marker in (str(self.profile), str(self.home)):
            kill_matching(marker)


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


class Page:
    """One tab, driven as a user would: navigate, type, click, read its text."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session
        self.call("Page.enable")
        self.call("Network.enable")  # requests and WebSocket frames land in browser.events

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.call(method, params, session=self.session)

    def navigate(self, url: str) -> None:
        seen = len(self.browser.events)
        self.call("Page.navigate", {"url": url})
        self.browser.wait_event("Page.loadEventFired", session=self.session, after=seen)

    def evaluate(self, expression: str, *, timeout_ms: int | None = None) -> Any:
        """The value of a JS expression (promises awaited). DevTools evaluation is not bound by
        the page's CSP, so tests can inspect a page whose own policy forbids eval."""
        params: dict[str, Any] = {"expression": expression, "awaitPromise": True,
                                  "returnByValue": True}
        if timeout_ms is not None:
            params["timeout"] = timeout_ms
        result = self.call("Runtime.evaluate", params)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CdpError(details.get("exception", {}).get("description")
                           or details.get("text"))
        return result["result"].get("value")

    def wait_for(self, predicate: str, timeout: float = 20.0) -> Any:
        """Wait, without polling, until the JS function `predicate` returns something truthy:
        it is tested now and after every DOM change (a MutationObserver)."""
        ms = int(timeout * 1000)
        return self.evaluate(f"""new Promise((resolve, reject) => {{
            const test = () => {{ try {{ return ({predicate})(); }} catch {{ return false; }} }};
            const done = (v) => {{ observer.disconnect(); clearTimeout(timer); resolve(v); }};
            const observer = new MutationObserver(() => {{ const v = test(); if (v) done(v); }});
            const timer = setTimeout(() => {{ observer.disconnect(); reject(new Error(
                'not true within {timeout} s: ' + {json.dumps(predicate)} + '\\n--- page text:\\n' +
                (document.body ? document.body.innerText : ''))); }}, {ms});
            observer.observe(document, {{subtree: true, childList: true, characterData: true,
                                         attributes: true}});
            const first = test(); if (first) done(first);
        }})""")

    def text(self, selector: str = "body") -> str:
        return str(self.evaluate(f"document.querySelector({json.dumps(selector)}).innerText"))

    def click(self, selector: str, *, text: str | None = None) -> None:
        """A real mouse click at the middle of the first element matching `selector` (and
        containing `text`), as a user's."""
        box = self.wait_for(f"""() => {{
            const el = [...document.querySelectorAll({json.dumps(selector)})].find(
                e => {json.dumps(text)} === null || e.innerText.includes({json.dumps(text)}));
            if (!el || el.disabled) return null;
            el.scrollIntoView({{block: 'center'}});
            const r = el.getBoundingClientRect();
            return r.width && r.height ? {{x: r.x + r.width / 2, y: r.y + r.height / 2}} : null;
        }}""")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": box["x"], "y": box["y"],
                                                   "button": "left", "clickCount": 1})

    def type_into(self, selector: str, text: str) -> None:
        self.click(selector)
        self.call("Input.insertText", {"text": text})

    def press(self, key: str, *, shift: bool = False) -> None:
        """A key pressed and released as a user's (Enter, Escape), with Shift held if asked; its
        text (a line break for Enter) is typed unless the page prevents it."""
        code = {"Enter": 13, "Escape": 27}[key]
        down = {"key": key, "code": key, "windowsVirtualKeyCode": code,
                "modifiers": 8 if shift else 0}
        self.call("Input.dispatchKeyEvent", {"type": "keyDown", **down,
                                             **({"text": "\r"} if key == "Enter" else {})})
        self.call("Input.dispatchKeyEvent", {"type": "keyUp", **down})

    def choose(self, selector: str, value: str) -> None:
        """Pick `value` in a <select> as a user's pick does: the value changes, then its input
        and change events fire (headless Chromium draws no popup to click in)."""
        self.wait_for(f"""() => [...document.querySelectorAll({json.dumps(selector + ' option')})]
            .some(o => o.value === {json.dumps(value)} && !o.disabled)""")
        self.evaluate(f"""(() => {{ const s = document.querySelector({json.dumps(selector)});
            s.value = {json.dumps(value)};
            for (const kind of ['input', 'change']) s.dispatchEvent(new Event(kind,
                                                                   {{bubbles: true}})); }})()""")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))
        return path
