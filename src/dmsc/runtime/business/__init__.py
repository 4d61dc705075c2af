"""The business layer: API gateway, authentication, rate limits, service registry and router."""
