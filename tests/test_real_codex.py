"""What only the `codex` driver does, with the real `codex app-server` (@openai/codex, pinned
in tests/agents.json) against the fake model server. The cases every driver shares are in
tests/test_contract.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import T3Server
from real_cli import codex_provider, create, npm_available, wait

pytestmark = [pytest.mark.real_cli,
              pytest.mark.skipif(not npm_available(), reason="npm is not installed")]


@pytest.fixture
def server(model: FakeModelServer, tmp_path: Path, t3_factory: Any) -> T3Server:
    return t3_factory(providers=[codex_provider(tmp_path, model.url)])


def test_mcp_tools_are_split(server: T3Server, model: FakeModelServer) -> None:
    """t3_thread_wait is offered only by t3-code-direct; t3-code offers the rest."""
    mcp = server.client()
    created = create(mcp, "list tools")
    assert wait(mcp, created["threadId"])["status"] == "completed"
    offered: dict[str, set[str]] = {}
    for tool in model.requests_for("responses")[-1]["body"].get("tools") or []:
        if tool.get("type") == "namespace":
            offered[tool["name"]] = {t.get("name") for t in tool.get("tools") or []}
    assert offered.get("mcp__t3_code_direct") == {"t3_thread_wait"}, offered
    assert "t3_thread_read" in offered.get("mcp__t3_code", set()), offered
    assert "t3_thread_wait" not in offered.get("mcp__t3_code", set()), offered
