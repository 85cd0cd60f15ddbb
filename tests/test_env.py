"""``mla_runtime.env``: each variable's reading (unset, empty, set), without starting anything."""

from __future__ import annotations

import os

import pytest

from mla_runtime import env
from mla_runtime.engine import tp_workers

VARIABLES = ("MLA_API_KEY", "MLA_FAULT_INJECTION", "HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE",
             "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "MLA_TP_WAIT_S")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_every_variable_is_in_the_table():
    for name in VARIABLES:
        assert f"\n{name} " in env.__doc__, name


def test_unset_and_empty_read_as_none(monkeypatch):
    assert (env.api_key(), env.fault_injection(), env.hf_hub_cache()) == (None,) * 3
    assert env.tp_wait_s() == env.TP_WAIT_DEFAULT_S
    monkeypatch.setenv("MLA_API_KEY", "")
    assert env.api_key() is None
    assert env.api_key({"MLA_API_KEY": "k"}) == "k" and env.api_key({}) is None  # a given mapping, not os.environ


def test_hub_cache_and_offline(monkeypatch):
    monkeypatch.setenv("HF_HOME", "/home/hf")
    assert env.hf_hub_cache() == os.path.join("/home/hf", "hub")
    monkeypatch.setenv("HF_HUB_CACHE", "/cache")
    assert env.hf_hub_cache() == "/cache"
    for value, offline in (("1", True), (" Yes ", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert env.hf_hub_offline() is offline, value


def test_torchrun_ranks(monkeypatch):
    assert env.torchrun_world_size() is None and env.torchrun_rank() == 0
    assert not tp_workers.launched_by_torchrun()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env.torchrun_world_size() is None  # not started by torchrun: WORLD_SIZE alone does not count
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "2")
    assert (env.torchrun_world_size(), tp_workers.torchrun_rank(), tp_workers.launched_by_torchrun()) == (4, 2, True)


def test_overriding_restores_the_previous_value(monkeypatch):
    with env.overriding("MLA_FAULT_INJECTION", "step:3"):
        assert env.fault_injection() == "step:3"
    assert "MLA_FAULT_INJECTION" not in os.environ
    monkeypatch.setenv("MLA_FAULT_INJECTION", "stream:1")
    with pytest.raises(RuntimeError), env.overriding("MLA_FAULT_INJECTION", "step:2"):
        raise RuntimeError
    assert env.fault_injection() == "stream:1"


def test_a_bad_tp_wait_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("MLA_TP_WAIT_S", "12.5")
    assert env.tp_wait_s() == 12.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        monkeypatch.setenv("MLA_TP_WAIT_S", bad)
        with pytest.raises(ValueError, match="MLA_TP_WAIT_S"):
            env.tp_wait_s()
