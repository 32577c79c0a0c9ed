"""Who may talk to the server: the Host header, the page's Origin, and an optional API key.

Why each check exists:

* **Host** (DNS rebinding): a hostile page can make its own domain name resolve to
  127.0.0.1 and then read this server as same-origin. Such a request still carries the
  hostile name in ``Host``, so only names that cannot be rebound are accepted: IP
  literals, ``localhost``, this machine's own name, the bound host, and ``allowed_hosts``.
* **Origin** (cross-site WebSocket hijacking): browsers let any page open a WebSocket to
  any address, sending the page's origin along. ``/ws`` accepts only pages served by this
  server (Origin matches Host) and ``allowed_origins``. Clients that are not browsers send
  no Origin and are not affected; ``Origin: null`` (sandboxed frames, files) is refused.
* **API key** (``api_key``): for a server reachable from other machines. Accepted as
  ``Authorization: Bearer KEY``, as the WebSocket subprotocol ``parley.key.KEY`` (what a
  browser can send), or as ``?key=KEY``.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import Settings

log = logging.getLogger(__name__)

KEY_SUBPROTOCOL_PREFIX = "parley.key."
PROTOCOL_SUBPROTOCOL = "parley"
CLOSE_POLICY = 1008  # RFC 6455: the message (here: the connection) violates the server's policy


def _split_host(value: str) -> str:
    """The name part of a Host header or netloc, lower-cased, without port or IPv6 brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def local_names() -> set[str]:
    names = {"localhost"}
    for name in (socket.gethostname(), socket.getfqdn()):
        if name:
            names.add(name.lower())
    return names


def is_loopback(host: str) -> bool:
    name = _split_host(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class AccessPolicy:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._hosts = local_names() | {_split_host(settings.host)} | {h.lower() for h in settings.allowed_hosts}
        self._origins = {origin.rstrip("/").lower() for origin in settings.allowed_origins}

    def host_allowed(self, host_header: str | None) -> bool:
        if "*" in self._hosts:
            return True
        if not host_header:
            return False  # HTTP/1.1 requires Host; without it nothing can be checked
        name = _split_host(host_header)
        return _is_ip(name) or name in self._hosts or name.endswith(".localhost")

    def origin_allowed(self, origin: str | None, host_header: str | None) -> bool:
        if origin is None:
            return True  # not a browser page (parley mic, SDKs, curl): nothing to hijack
        origin = origin.strip().rstrip("/").lower()
        if "*" in self._origins or origin in self._origins:
            return True
        if origin == "null" or not host_header:
            return False
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.netloc == host_header.strip().lower()

    def key_required(self) -> bool:
        return bool(self.settings.api_key)

    def key_ok(self, headers: Mapping[str, str], query: Mapping[str, str], subprotocols: Iterable[str] = ()) -> bool:
        expected = self.settings.api_key
        if not expected:
            return True
        presented: list[str] = []
        authorization = headers.get("authorization", "")
        if authorization.lower().startswith("bearer "):
            presented.append(authorization[7:].strip())
        presented += [p[len(KEY_SUBPROTOCOL_PREFIX) :] for p in subprotocols if p.startswith(KEY_SUBPROTOCOL_PREFIX)]
        if "key" in query:
            presented.append(query["key"])
        return any(hmac.compare_digest(p.encode(), expected.encode()) for p in presented)

    def startup_warnings(self) -> list[str]:
        warnings = []
        if "*" in self._origins:
            warnings.append("allowed_origins='*': any web page the user visits can talk to this server")
        if "*" in self._hosts:
            warnings.append("allowed_hosts='*': DNS-rebinding protection is off")
        if not is_loopback(self.settings.host) and not self.settings.api_key:
            warnings.append(
                f"listening on {self.settings.host} without an api_key: anyone who can reach this port can use "
                "the assistant (set PARLEY_API_KEY, or bind 127.0.0.1 and use an SSH tunnel)"
            )
        wyoming = self.settings.wyoming_host
        if self.settings.wyoming_port is not None and not is_loopback(wyoming):
            warnings.append(
                f"the Wyoming door listens on {wyoming}: the protocol has no authentication, so anyone who can reach "
                "that port can use the assistant (keep it on a trusted network, or bind 127.0.0.1)"
            )
        return warnings


class HostGuard:
    """ASGI middleware: every HTTP request and WebSocket with a Host outside the policy is refused."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app, self.policy = app, policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), None)
            if not self.policy.host_allowed(host):
                log.warning("refused a request for Host %r (allowed_hosts)", host)
                if scope["type"] == "http":
                    await _plain_response(send, 421, f"unknown host {host!r}: add it to allowed_hosts\n")
                else:
                    await send({"type": "websocket.close", "code": CLOSE_POLICY, "reason": "unknown host"})
                return
        await self.app(scope, receive, send)


async def _plain_response(send: Send, status: int, text: str) -> None:
    body = text.encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
