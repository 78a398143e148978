"""What only the `opencode` driver does, with the real `opencode serve` (opencode-ai, pinned in
tests/agents.json) against the fake model server (research/agents.md §6). The cases every driver
shares are in tests/test_contract.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import T3Server
from real_cli import create, npm_available, opencode_provider, text, wait

pytestmark = [pytest.mark.real_cli,
              pytest.mark.skipif(not npm_available(), reason="npm is not installed")]


@pytest.fixture
def server(model: FakeModelServer, tmp_path: Path, t3_factory: Any) -> T3Server:
    return t3_factory(providers=[opencode_provider(tmp_path, model.url)])


def test_own_mcp_tools_need_no_approval(server: T3Server) -> None:
    """t3's own tools run without an approval even in approval-required mode: opencode does
    not gate remote MCP tools, and t3 asks only for bash and edits."""
    mcp = server.client()
    created = create(mcp, 'CALL_MCP t3_thread_interrupt {"threadId": "thread:none"}',
                     runtimeMode="approval-required")
    done = wait(mcp, created["threadId"])
    assert done["status"] == "completed" and done["pendingApproval"] is None, done
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])
