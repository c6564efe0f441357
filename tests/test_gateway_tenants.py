"""gateway/tenants.py and gateway/rate_limit.py alone: the keys file, the tenants' cache salts, and the
per-tenant token buckets on a fake clock."""

from __future__ import annotations

import logging

import pytest

from gateway.rate_limit import TenantLimits, retry_after
from gateway.tenants import CacheSalts, TenantKeys, parse_keys


def test_a_keys_file_maps_keys_to_tenants(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("# key tenant\nsk-a1 alice\n\nsk-a2 alice  # her second key\nsk-b bob\n")
    keys = TenantKeys(str(path), "sk-admin")
    assert keys.lookup(b"sk-a1") == (True, "alice")
    assert keys.lookup(b"sk-a2") == (True, "alice")
    assert keys.lookup(b"sk-b") == (True, "bob")
    assert keys.lookup(b"sk-admin") == (True, "default")  # --api-key beside a file: tenant `default`
    assert keys.lookup(b"sk-a") == (False, None)
    assert TenantKeys(None, "sk-only").lookup(b"sk-only") == (True, None)  # no file: no tenants


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("sk-secret-1 alice extra\n", "line 1: expected `KEY TENANT`, 3 fields found"),
        ("sk-ok bob\nsk-secret-1\n", "line 2: expected `KEY TENANT`, 1 fields found"),
        ("sk-secret-1 alice\nsk-secret-1 bob\n", "line 2: a key given twice, for two tenants"),
    ],
)
def test_a_bad_keys_file_names_the_line_never_the_key(text: str, error: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_keys(text)
    assert str(exc.value) == error and "sk-secret" not in str(exc.value)


def test_a_reload_takes_the_new_file_and_a_bad_one_keeps_the_old_keys(tmp_path, caplog) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-a alice\n")
    keys = TenantKeys(str(path))
    path.write_text("sk-c carol\n")
    keys.reload_or_keep()
    assert keys.lookup(b"sk-c") == (True, "carol") and keys.lookup(b"sk-a") == (False, None)
    path.write_text("sk-d-secret dave extra\n")
    with caplog.at_level(logging.ERROR, logger="gateway.tenants"):
        keys.reload_or_keep()
    assert keys.lookup(b"sk-c") == (True, "carol")
    assert "not reloaded" in caplog.text and "sk-d-secret" not in caplog.text


def test_each_tenant_has_its_own_cache_salt() -> None:
    salts = CacheSalts("server-secret")
    alice, bob = salts.salt("alice", None), salts.salt("bob", None)
    assert alice == CacheSalts("server-secret").salt("alice", None)  # stable across gateways sharing it
    assert alice != bob and alice != CacheSalts("other-secret").salt("alice", None)
    # a client's own salt is scoped to its tenant: bob cannot pick a salt that lands in alice's cache
    assert salts.salt("alice", "x") not in (alice, salts.salt("bob", "x"), "x")
    assert salts.salt("bob", alice) != alice
    assert salts.salt(None, "x") == "x" and salts.salt(None, None) == ""  # no tenants: vLLM's behaviour


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_second_per_tenant() -> None:
    clock = Clock()
    limits = TenantLimits(requests_per_s=2, clock=clock)
    assert limits.admit("alice") is None and limits.admit("alice") is None  # a second's worth: 2
    assert limits.admit("alice") == pytest.approx(0.5)
    assert limits.admit("bob") is None  # its own bucket
    clock.now += 0.5
    assert limits.admit("alice") is None
    assert limits.admit("alice") == pytest.approx(0.5)


def test_tokens_per_second_are_charged_after_the_request() -> None:
    clock = Clock()
    limits = TenantLimits(tokens_per_s=100, clock=clock)
    assert limits.admit("alice") is None
    limits.charge("alice", 250)  # a request that used 250 tokens: 150 in debt
    assert limits.admit("alice") == pytest.approx(1.5)
    assert limits.admit("bob") is None
    clock.now += 1.5
    assert limits.admit("alice") is None
    assert TenantLimits().admit("alice") is None  # no limits


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert [retry_after(s) for s in (0.01, 1.0, 1.2, 4.9)] == ["1", "1", "2", "5"]
    with pytest.raises(ValueError, match="must be positive"):
        TenantLimits(requests_per_s=0)
