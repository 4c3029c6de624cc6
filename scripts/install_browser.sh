#!/usr/bin/env bash
# Install Debian's Chromium for the Playwright browser tests (tests/browser/), if missing, plus
# fonts for Chinese text and emoji (best effort: the tests pass without them, screenshots look
# better with them). Run as root. Exit status 0 when /usr/bin/chromium is usable afterwards.
set -euo pipefail

have_chromium() { [ -x /usr/bin/chromium ] && /usr/bin/chromium --version >/dev/null 2>&1; }
have_fonts() { [ -d /usr/share/fonts/opentype/noto ] && [ -d /usr/share/fonts/truetype/noto ]; }

if have_chromium && have_fonts; then
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    if have_chromium; then exit 0; fi
    echo "install_browser.sh: chromium is missing and installing it needs root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update
if ! have_chromium; then
    apt-get install -y --no-install-recommends chromium fonts-dejavu-core
fi
if ! have_fonts; then
    apt-get install -y --no-install-recommends fonts-noto-cjk fonts-noto-color-emoji \
        || echo "install_browser.sh: CJK/emoji fonts not installed (screenshots show boxes)" >&2
fi
/usr/bin/chromium --version
