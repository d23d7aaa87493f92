"""Redis passwords never reach a log or an error message: URLs and settings show them masked."""

from __future__ import annotations

import pytest

from streamq.broker.connection import redis_settings_for
from streamq.redaction import redact_url

PASSWORD = "s3cret-pw"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"redis://streamq:{PASSWORD}@redis.internal:6379/0", "redis://streamq:***@redis.internal:6379/0"),
        (f"redis://:{PASSWORD}@localhost", "redis://:***@localhost"),
        (
            f"rediss://app:{PASSWORD}@cache.example:6380?ssl_ca_certs=/ca.pem",
            "rediss://app:***@cache.example:6380?ssl_ca_certs=/ca.pem",
        ),
        (f"redis+sentinel://app:{PASSWORD}@s1:26379,s2/mymaster", "redis+sentinel://app:***@s1:26379,s2/mymaster"),
        (f"unix://:{PASSWORD}@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
    ],
)
def test_a_url_shows_everything_but_its_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", ["redis://localhost:6379", "redis://streamq@localhost", "unix:///run/redis.sock"])
def test_a_url_without_a_password_is_shown_as_it_is(url: str) -> None:
    assert redact_url(url) == url


def test_a_password_with_an_at_sign_is_masked_whole() -> None:
    assert redact_url("redis://u:p@ss@host:6379") == "redis://u:***@host:6379"


def test_settings_repr_masks_the_password() -> None:
    shown = repr(redis_settings_for(f"redis://streamq:{PASSWORD}@redis.internal:6379"))
    assert PASSWORD not in shown
    assert "password='***'" in shown and "username='streamq'" in shown


def test_a_bad_sentinel_url_is_refused_without_its_password() -> None:
    with pytest.raises(ValueError) as refused:
        redis_settings_for(f"redis+sentinel://app:{PASSWORD}@s1.example,/m")
    assert PASSWORD not in str(refused.value)
    assert "app:***@" in str(refused.value)
