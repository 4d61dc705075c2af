"""The business layer: service registry and the RPC plumbing services share."""
