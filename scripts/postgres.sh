#!/usr/bin/env bash
# Make a local PostgreSQL server available for the tests and print its SQLAlchemy URL.
# Installs Debian's postgresql package when missing (this needs root, as on CI), starts the
# default cluster on 127.0.0.1:5432 and creates a `dmsc` role and database. Idempotent.
set -euo pipefail
exec 3>&1 1>&2  # everything but the URL goes to stderr
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
fi
version=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! pg_lsclusters -h | grep -q "^$version main"; then
  pg_createcluster "$version" main >/dev/null
fi
# The server must inherit none of our descriptors: fd 3 is the caller's `$(...)` pipe, and a
# daemon holding it (or any pipe of the CI runner) open keeps `make test` waiting forever.
# Python's subprocess closes every descriptor above 2 (close_fds), which bash cannot do by itself.
python3 -c 'import subprocess as s, sys; s.run(sys.argv[1:], stdin=s.DEVNULL,
  stdout=s.DEVNULL, stderr=s.DEVNULL, close_fds=True)' pg_ctlcluster "$version" main start || true
for _ in $(seq 1 30); do
  pg_isready -h 127.0.0.1 -p 5432 -q && break
  sleep 0.5
done
su postgres -c "psql -q -p 5432 -tc \"SELECT 1 FROM pg_roles WHERE rolname='dmsc'\"" | grep -q 1 ||
  su postgres -c "psql -q -p 5432 -c \"CREATE ROLE dmsc LOGIN SUPERUSER PASSWORD 'dmsc'\""
su postgres -c "psql -q -p 5432 -tc \"SELECT 1 FROM pg_database WHERE datname='dmsc'\"" | grep -q 1 ||
  su postgres -c "psql -q -p 5432 -c \"CREATE DATABASE dmsc OWNER dmsc\""
echo "postgresql+psycopg://dmsc:dmsc@127.0.0.1:5432/dmsc" >&3
