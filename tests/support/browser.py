"""A real headless browser for page tests: Debian's `chromium` (installed by scripts/setup.sh),
driven over the Chrome DevTools protocol on a websocket (aiohttp's client). Started per test and
stopped by PID."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless chromium with one page: `open(url)`, `evaluate(js)`, `screenshot(path)`."""

    def __init__(self) -> None:
        if CHROMIUM is None:
            raise RuntimeError("no chromium on PATH: scripts/setup.sh installs Debian's chromium for the page tests")
        self._profile = Path(tempfile.mkdtemp(prefix="agentrl-chromium-"))
        self._proc: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws = None
        self._next_id = 0
        self._events: list[dict] = []

    async def __aenter__(self) -> Browser:
        # --no-sandbox: chromium refuses to run as root with its own sandbox.
        self._proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                       "--disable-dev-shm-usage", "--remote-debugging-port=0",
                                       f"--user-data-dir={self._profile}", "--window-size=1280,900", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not open its DevTools port (exit {self._proc.poll()})")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json(content_type=None)
        page = next(t for t in targets if t["type"] == "page")
        self._ws = await self._session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            if self._ws is not None:
                await self._ws.close()
            if self._session is not None:
                await self._session.close()
        finally:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=15)
            shutil.rmtree(self._profile, ignore_errors=True)

    async def send(self, method: str, **params) -> dict:
        self._next_id += 1
        call_id = self._next_id
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            msg = json.loads((await asyncio.wait_for(self._ws.receive(), 60)).data)
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._events.append(msg)

    async def open(self, url: str, timeout_s: float = 60) -> None:
        """Navigate and wait for the page's load event."""
        self._events.clear()
        await self.send("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not any(e.get("method") == "Page.loadEventFired" for e in self._events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load within {timeout_s} s")
            msg = json.loads((await asyncio.wait_for(self._ws.receive(), timeout_s)).data)
            self._events.append(msg)

    async def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        data = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(data["data"]))
