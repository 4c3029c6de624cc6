#!/usr/bin/env bash
# Install Debian's Chromium for the Playwright browser tests (tests/browser/), if missing.
# Run as root. Exit status 0 when /usr/bin/chromium is usable afterwards.
set -euo pipefail

if [ -x /usr/bin/chromium ] && /usr/bin/chromium --version >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "install_browser.sh: chromium is missing and installing it needs root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends chromium fonts-dejavu-core
/usr/bin/chromium --version
