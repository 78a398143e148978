"""The real agent CLIs for `real_cli` tests: pinned in tests/agents.json, installed with
`npm install --prefix` into a cache directory (reused when present), each run with its state in
a temp directory and its model replaced by tests/fake_model.py.

    python tests/real_cli.py install [name ...]    # what .ci/run does before the tests
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["AGENTS", "cache_dir", "installed", "ensure_installed", "npm_available",
           "create", "wait", "text"]

AGENTS: dict[str, dict[str, str]] = json.loads(
    (Path(__file__).resolve().parent / "agents.json").read_text())


def cache_dir() -> Path:
    root = os.environ.get("T3_AGENTS_CACHE") or str(Path.home() / ".cache" / "t3-test-agents")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _prefix(name: str) -> Path:
    spec = AGENTS[name]
    return cache_dir() / f"{name}-{spec['version']}"


def installed(name: str) -> Path | None:
    binary = _prefix(name) / "node_modules" / ".bin" / AGENTS[name]["bin"]
    return binary if binary.exists() else None


def npm_available() -> bool:
    return shutil.which("npm") is not None


def ensure_installed(name: str) -> Path:
    """The CLI's executable, installing the pinned version first if needed (one installer at a
    time across test workers)."""
    found = installed(name)
    if found:
        return found
    spec = AGENTS[name]
    with open(cache_dir() / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = installed(name)
        if found:
            return found
        prefix = _prefix(name)
        partial = prefix.with_name(prefix.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        subprocess.run(["npm", "install", "--prefix", str(partial), "--no-audit", "--no-fund",
                        "--loglevel=error", f"{spec['package']}@{spec['version']}"],
                       check=True, timeout=900)
        shutil.rmtree(prefix, ignore_errors=True)
        partial.rename(prefix)  # only a complete install is ever seen as installed
    found = installed(name)
    if found is None:
        raise RuntimeError(f"{spec['package']}@{spec['version']} installed no {spec['bin']}")
    return found


# ---------------------------------------------------------------- driving t3 in real-CLI tests

def create(mcp: Any, prompt: str, **entry: Any) -> dict[str, Any]:
    """create_threads with one prompt; the created thread."""
    result = mcp.call("create_threads", {"threads": [{"prompt": prompt, **entry}]})
    assert result.ok, result.structured
    return result.structured["threads"][0]


def wait(mcp: Any, thread_id: str, **args: Any) -> dict[str, Any]:
    """t3_thread_wait with room for a real CLI's slow start."""
    result = mcp.call("t3_thread_wait", {"threadId": thread_id, "timeoutMs": 120_000, **args},
                      timeout=180)
    assert result.ok, result.structured
    return result.structured


def text(mcp: Any, thread_id: str) -> str:
    """The thread's assistant text, oldest first."""
    page = mcp.call("t3_thread_read", {"threadId": thread_id, "afterPosition": -1,
                                       "limit": 100}).structured
    return "\n".join(i["text"] or "" for i in page["items"] if i["type"] == "assistant_message")


def main(argv: list[str]) -> int:
    if argv[:1] != ["install"]:
        print(__doc__, file=sys.stderr)
        return 2
    for name in argv[1:] or list(AGENTS):
        print(f"{name}: {ensure_installed(name)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
