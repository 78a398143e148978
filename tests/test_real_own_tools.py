"""t3's own MCP tools need no approval, even in approval-required mode, with the real CLIs whose
drivers arrange it (pinned in tests/agents.json, against the fake model server): codex gets them
with default_tools_approval_mode "approve" (the credential already scopes them); opencode does not
gate remote MCP tools, and t3 asks only for bash and edits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from real_cli import codex_provider, create, npm_available, opencode_provider, text, wait

pytestmark = [pytest.mark.real_cli,
              pytest.mark.skipif(not npm_available(), reason="npm is not installed")]


@pytest.mark.parametrize("provider", [codex_provider, opencode_provider],
                         ids=["codex", "opencode"])
def test_own_mcp_tools_need_no_approval(provider: Callable[[Path, str], dict[str, Any]],
                                        model: FakeModelServer, tmp_path: Path,
                                        t3_factory: Any) -> None:
    """A t3 tool that is not read-only runs without a runtime request in approval-required."""
    mcp = t3_factory(providers=[provider(tmp_path, model.url)]).client()
    created = create(mcp, 'CALL_MCP t3_thread_interrupt {"threadId": "thread:none"}',
                     runtimeMode="approval-required")
    done = wait(mcp, created["threadId"])
    assert done["status"] == "completed" and done["pendingApproval"] is None, done
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])
