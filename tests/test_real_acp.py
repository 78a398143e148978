"""ACP-specific real-CLI checks (the shared cases are in test_contract.py): t3 selects an ACP
agent's own mode for the thread's runtime mode."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from fake_model import FakeModelServer
from harness import protocol_log
from real_cli import acp_provider, create, text, wait

pytestmark = pytest.mark.real_cli

# The agent's own never-ask mode t3 selects for full-access (codex-acp 0.16.0 advertises none).
FULL_ACCESS_MODE = {"claude-agent-acp": "bypassPermissions", "codex-acp": None, "gemini": "yolo"}


@pytest.mark.parametrize("cli", sorted(FULL_ACCESS_MODE))
def test_full_access_selects_the_agents_mode(cli: str, model: FakeModelServer, tmp_path: Path,
                                             t3_factory: Any) -> None:
    """In full-access mode t3 switches the agent to its own never-ask mode where it has one, and
    a tool call runs without a runtime request."""
    server = t3_factory(providers=[acp_provider(cli, tmp_path, model.url)])
    mcp = server.client()
    created = create(mcp, "USE_TOOL: echo fake-tool-ran", runtimeMode="full-access")
    done = wait(mcp, created["threadId"])
    assert done["status"] == "completed" and done["pendingApproval"] is None, done
    assert "TOOL_RESULT_SEEN" in text(mcp, created["threadId"])
    log = protocol_log(server.data_dir / "logs" / "provider-agent.log.gz")
    chosen = re.findall(r'"method":"session/set_mode","params":\{[^}]*"modeId":"([^"]+)"', log)
    assert chosen == ([FULL_ACCESS_MODE[cli]] if FULL_ACCESS_MODE[cli] else [])
