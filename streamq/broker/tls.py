"""TLS to Redis that checks whom it talks to.

A ``rediss://`` connection verifies the server's certificate (against the system's CAs, or
``?ssl_ca_certs=``) and that it names the host connected to. Turning either check off takes
an explicit word in the URL (``?ssl_cert_reqs=none``, ``?ssl_check_hostname=false``) or
``--tls-insecure``, and is logged as a warning naming what is no longer checked.
"""

from __future__ import annotations

import logging
import ssl
from typing import Final
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

from arq.connections import RedisSettings
from redis.exceptions import ConnectionError as RedisConnectionError

from streamq.environment import parse_flag

logger = logging.getLogger("streamq.tls")

CERT_REQS: Final = ("none", "optional", "required")
"""``?ssl_cert_reqs=``: whether the server must present a certificate the CA signed."""

INSECURE_QUERY: Final = {"ssl_cert_reqs": "none"}
"""What ``--tls-insecure`` adds to a URL."""


class TlsVerificationError(RedisConnectionError):
    """The Redis server's certificate was refused: retrying cannot help, so it is not retried."""


def apply_tls_query(settings: RedisSettings, url: str) -> None:
    """Set ``settings``' TLS options from ``url``'s query; verification stays on unless it says otherwise.

    ``ssl_ca_certs`` (the CA file), ``ssl_certfile``/``ssl_keyfile`` (a client certificate),
    ``ssl_cert_reqs`` (``none|optional|required``, default ``required``) and
    ``ssl_check_hostname`` (default: on whenever the certificate is verified)."""
    query = {name: values[-1] for name, values in parse_qs(urlparse(url).query).items()}
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in query:
            setattr(settings, name, query[name])
    cert_reqs = query.get("ssl_cert_reqs", "required").lower()
    if cert_reqs not in CERT_REQS:
        raise ValueError(f"ssl_cert_reqs={cert_reqs!r}: expected one of {', '.join(CERT_REQS)}")
    settings.ssl_cert_reqs = cert_reqs
    check_hostname = parse_flag("ssl_check_hostname", query.get("ssl_check_hostname"), default=cert_reqs != "none")
    if check_hostname and cert_reqs == "none":
        raise ValueError("ssl_check_hostname=true needs the certificate verified: drop ssl_cert_reqs=none")
    settings.ssl_check_hostname = check_hostname
    if settings.ssl:
        warn_if_unverified(settings)


_warned: set[tuple[str, bool, bool]] = set()
"""Warnings already logged: settings are built more than once per process (arq's and ours)."""


def warn_if_unverified(settings: RedisSettings) -> None:
    """Log what a TLS connection to ``settings`` no longer checks, if anything (once per process)."""
    where = f"{settings.host}:{settings.port}"
    key = (where, settings.ssl_cert_reqs == "none", settings.ssl_check_hostname)
    if key in _warned:
        return
    _warned.add(key)
    if settings.ssl_cert_reqs == "none":
        logger.warning(
            "TLS to Redis at %s does not verify the server's certificate nor its host name "
            "(ssl_cert_reqs=none / --tls-insecure): anyone on the path can pose as Redis and read "
            "the password, prompts and tokens",
            where,
        )
    elif not settings.ssl_check_hostname:
        logger.warning(
            "TLS to Redis at %s does not check the certificate's host name (ssl_check_hostname=false): "
            "any certificate the CA signed, for any host, is accepted",
            where,
        )


def insecure_url(url: str) -> str:
    """``url`` with certificate and host-name verification turned off (``--tls-insecure``)."""
    parts = urlparse(url)
    query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    query.pop("ssl_check_hostname", None)
    return urlunparse(parts._replace(query=urlencode(query | INSECURE_QUERY)))


def certificate_refusal(error: BaseException | None) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind ``error`` (redis-py wraps it), if that is what it is."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ssl.SSLCertVerificationError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def refusal_error(settings: RedisSettings, refusal: ssl.SSLCertVerificationError) -> TlsVerificationError:
    """A message that says why the server was refused and what the way out is."""
    reason = refusal.verify_message or str(refusal)
    return TlsVerificationError(
        f"TLS to Redis at {settings.host}:{settings.port}: the server's certificate was refused ({reason}). "
        "Connect by a host name the certificate names, give the CA that signed it with ?ssl_ca_certs=/path/ca.pem, "
        "or (anyone on the path could then pose as Redis) turn verification off with ?ssl_cert_reqs=none "
        "or --tls-insecure"
    )
