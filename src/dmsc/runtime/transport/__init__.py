"""Plumbing shared by every service: gRPC, wire frames, typed control messages, logs, metrics,
and whether a process runs."""
