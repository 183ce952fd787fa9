"""A throw-away PostgreSQL server for tests and benchmarks: ``initdb`` and ``pg_ctl`` in a
temporary folder, TCP on 127.0.0.1 on a free port, trust authentication for ``postgres``.

:class:`PostgresServer` is what the test fixtures (``tests/conftest.py``) and
``benchmarks/bench_replicas.py`` start. Besides start and stop it can crash the server
(:meth:`PostgresServer.kill9`: SIGKILL to the postmaster and every process it started, as a
power cut or the OOM killer would leave it, minus the page cache) and start it again on the same
data folder (:meth:`PostgresServer.restart`: PostgreSQL's crash recovery replays the WAL).

Where the programs are absent, :func:`missing_programs` names them (the tests skip with that
reason). Running as root, the server runs as ``nobody`` (initdb refuses root), or as a
``pgtest`` system user created for it where there is no ``nobody``.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from anomaly_hooks.errors import AnomalyHooksError

PROGRAMS = ("initdb", "pg_ctl")


class PostgresUnavailableError(AnomalyHooksError):
    """No throw-away PostgreSQL server can be started here (programs or a user missing)."""


def find_program(name: str) -> Optional[str]:
    """The PostgreSQL program ``name`` on the PATH or in Debian's /usr/lib/postgresql/*/bin."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))
    return str(candidates[-1]) if candidates else None


def missing_programs() -> List[str]:
    """The programs of :data:`PROGRAMS` that are not installed (empty: a server can start)."""
    return [name for name in PROGRAMS if find_program(name) is None]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unprivileged_user() -> Tuple[int, int]:
    """(uid, gid) of a user initdb accepts when running as root: ``nobody``, else a ``pgtest``
    system user created for it (:class:`PostgresUnavailableError` where neither can be had)."""
    import pwd

    for name in ("nobody", "pgtest"):
        try:
            entry = pwd.getpwnam(name)
            return entry.pw_uid, entry.pw_gid
        except KeyError:
            continue
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                           "/usr/sbin/nologin", "pgtest"], capture_output=True, text=True)
    if made.returncode != 0:
        raise PostgresUnavailableError(
            "running as root and no unprivileged user for PostgreSQL (initdb refuses root; "
            f"useradd pgtest failed: {made.stderr.strip()})")
    entry = pwd.getpwnam("pgtest")
    return entry.pw_uid, entry.pw_gid


class PostgresServer:
    """``initdb`` + ``pg_ctl start`` in a temporary folder: TCP on 127.0.0.1 on a free port,
    its unix socket in the folder, trust authentication for the ``postgres`` user, fsync on."""

    def __init__(self, max_connections: int = 200) -> None:
        missing = missing_programs()
        if missing:
            raise PostgresUnavailableError(
                f"PostgreSQL programs not found ({', '.join(missing)}): install PostgreSQL "
                "(its server package)")
        self.initdb, self.pg_ctl = (str(find_program(t)) for t in PROGRAMS)
        # /tmp itself, not a test's tmp_path: its 0700 parents would keep another user out
        self.root = Path(tempfile.mkdtemp(prefix="anomaly-hooks-pg-"))
        self.data = self.root / "data"
        self.log_path = self.root / "server.log"
        self.port = free_port()
        self.max_connections = max_connections
        self.user: Optional[Tuple[int, int]] = unprivileged_user() if os.geteuid() == 0 else None
        if self.user is not None:
            os.chown(self.root, *self.user)
        self._admin: Any = None
        self._databases = 0

    def _run(self, *args: str) -> None:
        kw: Dict[str, Any] = {}
        if self.user is not None:
            kw = {"user": self.user[0], "group": self.user[1], "extra_groups": []}
        env = {**os.environ, "HOME": str(self.root), "LC_ALL": "C"}
        done = subprocess.run(list(args), capture_output=True, text=True, cwd=self.root,
                              env=env, timeout=120, **kw)
        if done.returncode != 0:
            tail = (self.log_path.read_text(errors="replace")[-2000:]
                    if self.log_path.exists() else "")
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}):\n"
                               f"{done.stdout}\n{done.stderr}\n{tail}")

    def start(self) -> "PostgresServer":
        """Create the cluster and start the server (returns once it accepts connections)."""
        # --no-sync: initdb's own files only; the server runs with fsync on, as in production
        self._run(self.initdb, "-D", str(self.data), "-A", "trust", "-U", "postgres",
                  "-E", "UTF8", "--no-locale", "--no-sync")
        self._pg_start()
        return self

    def _pg_start(self) -> None:
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} "
                   f"-c max_connections={self.max_connections}")
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.log_path),
                  "-w", "-t", "60", "-o", options, "start")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def admin(self) -> Any:
        """An autocommit connection to the ``postgres`` database (reopened when it died)."""
        import psycopg

        if self._admin is None or self._admin.closed or self._admin.broken:
            self._admin = psycopg.connect(self.url(), autocommit=True)
        return self._admin

    def new_database(self) -> str:
        """A fresh, empty database; its name."""
        self._databases += 1
        name = f"test_{self._databases}"
        self.admin().execute(f"CREATE DATABASE {name}")
        return name

    def drop_database(self, name: str) -> None:
        """Drop it, closing what is still connected (a store a test did not close)."""
        self.admin().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def postmaster_pid(self) -> Optional[int]:
        """The running postmaster's process id (None: not running)."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def kill9(self, timeout_s: float = 30.0) -> None:
        """Crash the server: SIGKILL to the postmaster and every process it started (its
        backends, checkpointer, WAL writer), then wait until they are all gone. Commits that
        were acknowledged are in the WAL (``synchronous_commit=on``); :meth:`restart` replays
        it."""
        pid = self.postmaster_pid()
        if pid is None:
            raise RuntimeError("the PostgreSQL server is not running")
        victims = [pid, *_children(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while any(_alive(v) for v in victims):  # reaped by their parent (init, for the
            if time.monotonic() > deadline:        # postmaster pg_ctl left behind)
                raise RuntimeError(f"PostgreSQL processes still there {timeout_s:g} s after "
                                   "SIGKILL (not reaped)")
            time.sleep(0.02)
        if self._admin is not None:
            self._admin.close()

    def restart(self) -> None:
        """Start the server again on the same data folder and port (after :meth:`kill9`:
        crash recovery first); returns once it accepts connections."""
        self._pg_start()

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its folder."""
        if self._admin is not None:
            self._admin.close()
        try:
            if self.postmaster_pid() is not None:
                self._run(self.pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "PostgresServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still exists, a zombie included (Linux: /proc): a new
    postmaster refuses to start while the old one's id answers ``kill(pid, 0)``."""
    return Path(f"/proc/{pid}").exists()


def _children(pid: int) -> List[int]:
    """The ids of the processes whose parent is ``pid`` (from /proc; empty without it)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out

