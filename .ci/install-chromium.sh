#!/usr/bin/env bash
# Install Debian's Chromium and its WebDriver (used by tests/console to drive the tenant console
# in a real, headless browser through Selenium). Idempotent: does nothing when both are there.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    echo "install-chromium: $(/usr/bin/chromium --version 2>/dev/null | head -n 1)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
echo "install-chromium: $(/usr/bin/chromium --version 2>/dev/null | head -n 1)"
