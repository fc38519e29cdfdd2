#!/usr/bin/env bash
# Install Debian's Prometheus (used by tests/dashboards to evaluate every dashboard query).
# Idempotent: does nothing when /usr/bin/prometheus is already there. The package does not
# start a server; the test runs its own on 127.0.0.1 with a temporary config and storage.
set -euo pipefail
if [ -x /usr/bin/prometheus ]; then
    echo "install-prometheus: $(/usr/bin/prometheus --version 2>&1 | head -n 1)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
echo "install-prometheus: $(/usr/bin/prometheus --version 2>&1 | head -n 1)"
