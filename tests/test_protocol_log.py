"""The provider traffic log (providers._ProtocolLog): every line kept in order across size
rotation, credentials redacted, and an ended turn's traffic on disk before t3 sees the end."""

from __future__ import annotations

import asyncio
from pathlib import Path

import providers
from orchestrator import TextDelta, TurnEnded


def logged(path: Path) -> list[str]:
    """The messages of a log and its rotated files, oldest first, without their timestamps."""
    files = sorted(path.parent.glob(f"{path.name}.*"), key=lambda p: -int(p.suffix[1:])) + [path]
    return [line.split(" ", 2)[2] for f in files for line in f.read_text().splitlines()]


def test_rotation_keeps_every_line_in_order(tmp_path: Path) -> None:
    """Lines written past the size limit roll over into .1, .2 ...; together they hold every
    line once, in order, with bearer tokens and Authorization values redacted."""
    path = tmp_path / "provider-x.log"
    log = providers._ProtocolLog(path, max_bytes=2_000, backup_count=50)
    lines = [f'agent[1] <- {{"n":{i},"text":"{i} "}}' for i in range(300)]
    lines[7] = 'agent[1] -> {"headers":[{"name":"Authorization","value":"Bearer s3cret-1"}]}'
    lines[150] = "agent[1] stderr using Bearer s3cret-2 for the call"
    for line in lines:
        log.write(line)
    log.close()
    assert len(list(tmp_path.glob("provider-x.log.*"))) > 5
    assert all(f.stat().st_size < 2_000 + 200 for f in tmp_path.iterdir())
    kept = logged(path)
    assert kept == [providers.redact(line) for line in lines]
    assert "s3cret" not in "".join(kept) and kept[150] == "agent[1] stderr using Bearer <redacted> for the call"


def test_rotation_drops_the_oldest_beyond_the_backup_count(tmp_path: Path) -> None:
    """With 3 backups only the newest four files remain, and they end with the last line."""
    path = tmp_path / "provider-x.log"
    log = providers._ProtocolLog(path, max_bytes=500, backup_count=3)
    for i in range(200):
        log.write(f"line {i}")
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "provider-x.log", "provider-x.log.1", "provider-x.log.2", "provider-x.log.3"]
    kept = logged(path)
    assert kept == [f"line {i}" for i in range(200 - len(kept), 200)]


def test_a_turn_end_flushes_the_log_before_it_is_delivered(tmp_path: Path) -> None:
    """Deltas stay buffered (flushed on a timer), but putting a turn's end or the process's end
    on a session's event queue writes everything logged so far to the file first."""
    path = tmp_path / "provider-x.log"

    async def scenario() -> list[int]:
        log = providers._ProtocolLog(path)
        events = providers._SessionEvents(log)
        sizes = []
        for end in (TurnEnded("completed"), None):
            log.write("agent[1] <- a delta")
            await events.put(TextDelta("a delta"))
            sizes.append(path.stat().st_size)  # still in the buffer: the timer has not fired
            await events.put(end)
            sizes.append(path.stat().st_size)
        log.close()
        return sizes

    sizes = asyncio.run(scenario())
    assert sizes[0] == 0 and sizes[1] > 0 and sizes[2] == sizes[1] and sizes[3] > sizes[2]
    assert logged(path) == ["agent[1] <- a delta"] * 2
