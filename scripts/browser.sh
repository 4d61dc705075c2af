#!/usr/bin/env bash
# Make Debian's headless Chromium and its WebDriver available for the dashboard's browser tests
# and print the driver's path. Installs the chromium and chromium-driver packages when missing
# (this needs root, as on CI). Idempotent.
set -euo pipefail
exec 3>&1 1>&2  # everything but the path goes to stderr
if ! command -v chromedriver >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
command -v chromedriver >&3
