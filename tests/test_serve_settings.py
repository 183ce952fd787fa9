"""The service's settings (settings.py) and its command-line options (cli.py)."""
from __future__ import annotations

import argparse

import pytest

from anomaly_hooks.serve.cli import add_arguments, settings_from_args
from anomaly_hooks.serve.settings import ServeSettings


@pytest.mark.parametrize("kw, message", [
    ({"max_batch": 0}, "max-batch"), ({"max_queue": 4, "max_batch": 8}, "max-queue"),
    ({"keep_images": "some"}, "keep-images"), ({"token": "short"}, "8 characters"),
    ({"retention_count": 0}, "retention-count"), ({"models_dir": "/no/such/folder"}, "models-dir"),
    ({"header_timeout_s": 0}, "header-timeout"), ({"idle_timeout_s": float("nan")}, "idle-timeout"),
    ({"header_timeout_s": float("inf")}, "header-timeout"),
    ({"request_timeout_s": -1}, "request-timeout"), ({"max_connections": -1}, "max-connections"),
    ({"max_connections_per_client": -2}, "max-connections-per-client")])
def test_settings_refuse_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(model="m", **kw).validate()


def test_token_from_environment(monkeypatch):
    monkeypatch.setenv("ANOMALY_HOOKS_TOKEN", "from-the-env")
    assert ServeSettings(model="m").token == "from-the-env"
    assert ServeSettings(model="m", token="explicit-token").token == "explicit-token"
    assert ServeSettings(model="m").public()["token"] == "set"


def test_results_db_option_and_its_conflicts():
    """--results-db: a database URL for the log (pictures still under --results-dir); it
    contradicts --no-results; an unknown scheme is refused before anything is opened; the
    settings shown on GET /v1/model never hold the database password."""
    from anomaly_hooks.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    url = "postgresql://inspect:hunter2@db.example:5432/line3"
    s = settings_from_args(parser.parse_args(["--model", "m", "--results-db", url]))
    assert (s.results_db, s.results_dir, s.keeps_results) == (url, "serve_results", True)
    shown = s.public()["results_db"]
    assert "hunter2" not in shown and shown == "postgresql://inspect:***@db.example:5432/line3"
    with pytest.raises(ConfigError, match="contradict"):
        settings_from_args(parser.parse_args(["--model", "m", "--results-db", url,
                                              "--no-results"]))
    with pytest.raises(ConfigError, match="unsupported results store mysql://"):
        ServeSettings(model="m", results_db="mysql://u:pw@h/db").validate()
    assert not ServeSettings(model="m", results_dir=None).keeps_results
    assert ServeSettings(model="m", results_dir=None, results_db="sqlite:///x").keeps_results




def test_models_dir_option(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m.safetensors", "--models-dir", str(tmp_path)])
    assert settings_from_args(args).models_dir == str(tmp_path)
    args = parser.parse_args(["--model", "m.safetensors"])
    assert settings_from_args(args).models_dir is None


def test_connection_options():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--header-timeout", "2.5", "--idle-timeout", "1",
                              "--max-connections", "0", "--max-connections-per-client", "8"])
    s = settings_from_args(args)
    assert (s.header_timeout_s, s.idle_timeout_s, s.max_connections,
            s.max_connections_per_client) == (2.5, 1.0, 0, 8)
    d = ServeSettings(model="m")
    assert (d.header_timeout_s, d.idle_timeout_s, d.max_connections,
            d.max_connections_per_client) == (10.0, 5.0, 1024, 64)


@pytest.mark.parametrize("case", ["not_a_database", "folder_is_a_file", "folder_is_a_database"])
def test_serve_refuses_a_results_log_it_cannot_open_in_one_line(case, tmp_path, capsys, fitted):
    """Before the server starts: one ``error:`` line naming the path, exit 2."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    from anomaly_hooks.cli import main

    model = fitted.save(tmp_path / "m.safetensors")
    results = tmp_path / "results"
    if case == "not_a_database":
        results.mkdir()
        (results / "results.sqlite").write_bytes(b"no SQLite database here\n" * 200)
    elif case == "folder_is_a_file":
        results.write_text("a file")
    else:
        (results / "results.sqlite").mkdir(parents=True)
    code = main(["serve", "--model", str(model), "--results-dir", str(results)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert str(results) in errors[0]


def test_serve_refuses_an_unreachable_results_db_in_one_line(tmp_path, capsys, fitted):
    """Nothing listens at the database's address: one ``error:`` line naming the URL without
    its password and what to check, exit 2, before the server starts."""
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    pytest.importorskip("psycopg", reason="psycopg (the [postgres] extra) is not installed")
    import socket

    from anomaly_hooks.cli import main

    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = fitted.save(tmp_path / "m.safetensors")
    url = f"postgresql://inspect:hunter2@127.0.0.1:{port}/line3"
    code = main(["serve", "--model", str(model), "--results-db", url])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"postgresql://inspect:***@127.0.0.1:{port}/line3" in errors[0]
    assert "hunter2" not in err and "--results-db" in errors[0]


def test_keep_heap_option():
    """--keep-heap: off by default (the service's resident memory stays glibc's own)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args(["--model", "m", "--keep-heap"])).keep_heap
    assert not settings_from_args(parser.parse_args(["--model", "m"])).keep_heap
    assert not ServeSettings(model="m").keep_heap


def test_keep_inputs_option_needs_kept_originals():
    """--keep-inputs: off by default; it keeps the input beside a kept original, so without
    --keep-originals it is refused, saying what to add."""
    from anomaly_hooks.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--keep-originals", "anomalous", "--keep-inputs"])
    assert settings_from_args(args).keep_inputs
    assert not settings_from_args(parser.parse_args(["--model", "m"])).keep_inputs
    with pytest.raises(ConfigError, match="keep-inputs.*keep-originals anomalous or all"):
        settings_from_args(parser.parse_args(["--model", "m", "--keep-inputs"]))
    with pytest.raises(ConfigError, match="keep-originals"):
        ServeSettings(model="m", keep_inputs=True).validate()
