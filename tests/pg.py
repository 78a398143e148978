"""A throwaway PostgreSQL server for the `postgres` test tier.

`PostgresServer.start()` makes a private cluster in a new temporary directory (Debian's layout:
`/usr/lib/postgresql/<n>/bin`, or `initdb` on PATH), listening on 127.0.0.1 and a free port only,
with trust authentication for user `t3`, and `stop()` removes it. `initdb` refuses to run as root:
as root the cluster belongs to the `postgres` system user (`runuser`). `database()` creates a new
empty database and returns its URL, so each test starts from nothing on a server the session
shares. `unavailable()` says why these tests cannot run here (no binaries, no psycopg), or None.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def _bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def unavailable() -> str | None:
    """Why the PostgreSQL tests must skip here, or None when they can run."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    if _bin_dir() is None:
        return "no PostgreSQL server binaries (initdb) here (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user to own a test cluster"
    return None


def _free_port() -> int:
    # Another process may take it before the server binds it; start() fails loudly then.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    def __init__(self) -> None:
        bin_dir = _bin_dir()
        assert bin_dir is not None, unavailable()
        self._bin = bin_dir
        self.dir = Path(tempfile.mkdtemp(prefix="t3-pg-"))
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._data = self.dir / "data"
        self.started = False

    def _run(self, *args: str) -> None:
        done = subprocess.run([*self._as, *args], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            log = (self.dir / "log").read_text() if (self.dir / "log").exists() else ""
            raise RuntimeError(f"{args[0]} failed: {done.stdout}{done.stderr}{log}")

    def start(self) -> PostgresServer:
        # Locale C: text compares and sorts by bytes, as in SQLite (store_pg refuses others).
        self._run(str(self._bin / "initdb"), "-D", str(self._data), "-A", "trust", "-U", "t3",
                  "-E", "UTF8", "--locale=C", "--no-sync")
        # fsync off: a test cluster is thrown away; nothing here tests PostgreSQL's durability.
        options = f"-p {self.port} -k {self.dir} -h 127.0.0.1 -c fsync=off -c max_connections=200"
        self._run(str(self._bin / "pg_ctl"), "-D", str(self._data), "-o", options,
                  "-l", str(self.dir / "log"), "-w", "start")
        self.started = True
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://t3@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database on this server; its URL."""
        import psycopg
        name = f"t3_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.started:
            self._run(str(self._bin / "pg_ctl"), "-D", str(self._data), "-m", "immediate", "stop")
            self.started = False
        shutil.rmtree(self.dir, ignore_errors=True)
