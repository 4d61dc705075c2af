"""The gateway over HTTPS: uvicorn's TLS settings and the ``Strict-Transport-Security`` header.

With TLS on, the port speaks TLS only: a plain-HTTP request to it is refused (the handshake
fails and the connection closes with no HTTP answer), not redirected. A redirect would be sent
after the request, its key and prompt with it, had already crossed the network in clear, and
would teach clients that the plain URL works; refusing makes the mistake visible at once.
"""

from __future__ import annotations

from typing import Any

HSTS = "max-age=31536000"  # a year: browsers keep to HTTPS for this host meanwhile


def uvicorn_tls(cert: str | None, key: str | None) -> dict[str, Any]:
    """uvicorn.Config's TLS arguments (none: plain HTTP).

    With TLS on, every answer says ``Strict-Transport-Security``: uvicorn's own ``headers``
    setting adds it to every response the server writes (a default header, as ``server`` and
    ``date`` are), so no ASGI layer wraps each request's ``send``. The port speaks TLS only, so
    each of its answers is an HTTPS one.
    """
    if cert is None or key is None:
        return {}
    return {
        "ssl_certfile": cert,
        "ssl_keyfile": key,
        "headers": [("strict-transport-security", HSTS)],
    }
