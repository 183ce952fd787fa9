"""Open a results store from a spec: a file path or ``sqlite:///path`` (SQLite, in
:mod:`.results`), or a ``postgresql://`` URL (:mod:`.pgstore`, the ``[postgres]`` extra). Kept
apart from both stores so that neither imports the other."""
from __future__ import annotations

from anomaly_hooks.errors import ConfigError
from anomaly_hooks.serve.results import ResultStore, SQLiteResultStore


def open_store(spec: str) -> ResultStore:
    """A store from a spec: a file path or ``sqlite:///path`` (SQLite), or a
    ``postgresql://`` / ``postgres://`` URL (PostgreSQL: the ``[postgres]`` extra)."""
    check_store_spec(spec)
    if spec.startswith(("postgresql://", "postgres://")):
        from anomaly_hooks.serve.pgstore import PostgresResultStore  # psycopg: optional

        return PostgresResultStore(spec)
    if spec.startswith("sqlite:///"):
        return SQLiteResultStore(spec[len("sqlite:///"):])
    return SQLiteResultStore(spec)


def check_store_spec(spec: str) -> None:
    """Refuse (``ConfigError``) a store spec :func:`open_store` cannot open, without opening
    it; the message never holds the spec's password."""
    if not spec:
        raise ConfigError("the results store spec is empty: give a file path, sqlite:///path "
                          "or postgresql://user@host/db")
    known = ("sqlite:///", "postgresql://", "postgres://")
    if "://" in spec and not spec.startswith(known):
        scheme = spec.split("://", 1)[0]
        raise ConfigError(f"unsupported results store {scheme}://...: give a file path, "
                          "sqlite:///path or postgresql://user@host/db (other databases: "
                          "implement ResultStore)")
