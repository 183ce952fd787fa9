"""The service's settings (settings.py) and its command-line options (cli.py)."""
from __future__ import annotations

import argparse

import pytest

from anomaly_hooks.serve.cli import add_arguments, settings_from_args
from anomaly_hooks.serve.settings import ServeSettings


@pytest.mark.parametrize("kw, message", [
    ({"max_batch": 0}, "max-batch"), ({"max_queue": 4, "max_batch": 8}, "max-queue"),
    ({"keep_images": "some"}, "keep-images"), ({"token": "short"}, "8 characters"),
    ({"retention_count": 0}, "retention-count"), ({"models_dir": "/no/such/folder"}, "models-dir")])
def test_settings_refuse_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(model="m", **kw).validate()


def test_token_from_environment(monkeypatch):
    monkeypatch.setenv("ANOMALY_HOOKS_TOKEN", "from-the-env")
    assert ServeSettings(model="m").token == "from-the-env"
    assert ServeSettings(model="m", token="explicit-token").token == "explicit-token"
    assert ServeSettings(model="m").public()["token"] == "set"




def test_models_dir_option(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m.safetensors", "--models-dir", str(tmp_path)])
    assert settings_from_args(args).models_dir == str(tmp_path)
    args = parser.parse_args(["--model", "m.safetensors"])
    assert settings_from_args(args).models_dir is None
