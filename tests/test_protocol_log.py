"""The provider traffic log (providers._ProtocolLog): every line kept in order across size
rotation, credentials redacted, and an ended turn's traffic on disk before t3 sees the end."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

import providers
from harness import protocol_log
from orchestrator import TextDelta, TurnEnded


def logged(path: Path) -> list[str]:
    """The messages of a log and its rotated files (x.log.gz, x.log.1.gz ...), oldest first,
    without their timestamps."""
    backups = path.parent.glob(path.name.replace(".gz", ".*.gz"))
    files = sorted(backups, key=lambda p: -int(p.suffixes[-2][1:])) + [path]
    return [line.split(" ", 2)[2] for f in files for line in protocol_log(f).splitlines()]


def test_rotation_keeps_every_line_in_order(tmp_path: Path) -> None:
    """Lines written past the size limit roll over into .1, .2 ...; together they hold every
    line once, in order, with bearer tokens and Authorization values redacted."""
    path = tmp_path / "provider-x.log.gz"
    log = providers._ProtocolLog(path, max_bytes=2_000, backup_count=50)
    lines = [f'agent[1] <- {{"n":{i},"text":"{i} "}}' for i in range(300)]
    lines[7] = 'agent[1] -> {"headers":[{"name":"Authorization","value":"Bearer s3cret-1"}]}'
    lines[150] = "agent[1] stderr using Bearer s3cret-2 for the call"
    for line in lines:
        log.write(line)
    log.close()
    assert len(list(tmp_path.glob("provider-x.log.*.gz"))) > 5
    assert all(f.stat().st_size < 2_000 + 200 for f in tmp_path.iterdir())
    kept = logged(path)
    assert kept == [providers.redact(line) for line in lines]
    assert "s3cret" not in "".join(kept)
    assert kept[150] == "agent[1] stderr using Bearer <redacted> for the call"


def test_rotation_drops_the_oldest_beyond_the_backup_count(tmp_path: Path) -> None:
    """With 3 backups only the newest four files remain, and they end with the last line."""
    path = tmp_path / "provider-x.log.gz"
    log = providers._ProtocolLog(path, max_bytes=500, backup_count=3)
    for i in range(200):
        log.write(f"line {i}")
    log.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "provider-x.log.1.gz", "provider-x.log.2.gz", "provider-x.log.3.gz", "provider-x.log.gz"]
    kept = logged(path)
    assert kept == [f"line {i}" for i in range(200 - len(kept), 200)]


def test_a_turn_end_flushes_the_log_before_it_is_delivered(tmp_path: Path) -> None:
    """Deltas stay buffered (flushed on a timer), but putting a turn's end or the process's end
    on a session's event queue writes everything logged so far to the file first."""
    path = tmp_path / "provider-x.log.gz"

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


class _Stdout:
    """What `_read_json_lines` reads: a process whose stdout is a fed StreamReader."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.stdout = reader


class _Process:
    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.proc = _Stdout(reader)


def read_lines(tmp_path: Path, writes: list[bytes]) -> tuple[list[dict], list[str]]:
    """Feed `writes`, then end of file (the reader hands them out in reads of up to 64 KiB);
    (messages handed on, lines logged)."""
    async def scenario() -> list[dict]:
        reader = asyncio.StreamReader()
        for data in writes:
            reader.feed_data(data)
        reader.feed_eof()
        log = providers._ProtocolLog(tmp_path / "provider-x.log.gz")
        got: list[dict] = []

        async def on_message(message: dict) -> None:
            got.append(message)
        process: Any = _Process(reader)  # only its stdout is read
        await providers._read_json_lines(process, log, "x[1]", on_message)
        log.close()
        return got

    got = asyncio.run(scenario())
    return got, logged(tmp_path / "provider-x.log.gz")


def test_json_lines_split_across_reads_arrive_whole_and_in_order(tmp_path: Path) -> None:
    """Lines are cut at newlines wherever the reads end: a line spread over several 64 KiB reads,
    many lines in one read, blank and non-JSON lines (logged, skipped) and a last line without its
    newline all come out as the reader of one line at a time would give them."""
    big = json.dumps({"n": 1, "text": "x" * 200_000}).encode()
    stream = (b'{"n": 0}\n\n' + big + b'\nnot json\n' + b"".join(
        json.dumps({"n": i}).encode() + b"\r\n" for i in range(2, 2000)) + b'{"n": 2000}')
    writes = [stream[i:i + 7_001] for i in range(0, len(stream), 7_001)]
    got, lines = read_lines(tmp_path, writes)
    assert [m["n"] for m in got] == list(range(2001)) and got[1]["text"] == "x" * 200_000
    assert len(lines) == 2002 and lines[2] == "x[1] <- not json"


def test_a_line_over_the_limit_stops_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line longer than the limit ends the reading (as readline's limit did); what came before
    it was handed on."""
    monkeypatch.setattr(providers, "_LINE_LIMIT", 100_000)
    got, _ = read_lines(tmp_path, [b'{"n": 0}\n' + b"y" * 70_000, b"y" * 70_000, b'\n{"n": 1}\n'])
    assert got == [{"n": 0}]


def test_a_log_cut_short_reads_back_and_is_never_appended_to(tmp_path: Path) -> None:
    """What a flush handed to the file decompresses without the gzip trailer (a kill -9 leaves
    none), and the next log opened on that path first moves the cut file to .1.gz: each file is
    one gzip member, whole once closed."""
    path = tmp_path / "provider-x.log.gz"
    first = providers._ProtocolLog(path)
    for i in range(3):
        first.write(f"line {i}")  # outside an event loop each line is flushed at once
    first._file.close()  # as a kill -9 would: no trailer
    cut = path.read_bytes()
    assert logged(path) == ["line 0", "line 1", "line 2"]
    second = providers._ProtocolLog(path)
    second.write("line 3")
    second.close()
    assert (tmp_path / "provider-x.log.1.gz").read_bytes() == cut
    assert gzip.decompress(path.read_bytes()).decode().endswith(" line 3\n")  # whole: trailer checked
    assert logged(path) == [f"line {i}" for i in range(4)]
