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
    """uvicorn.Config's TLS arguments (none: plain HTTP)."""
    if cert is None or key is None:
        return {}
    return {"ssl_certfile": cert, "ssl_keyfile": key}


class StrictTransport:
    """ASGI middleware: every answer over HTTPS says ``Strict-Transport-Security``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("scheme") != "https":
            await self.app(scope, receive, send)
            return

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"strict-transport-security", HSTS.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, sending)
