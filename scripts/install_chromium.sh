#!/usr/bin/env bash
# Install headless Chromium (Debian's package) when no Chromium is there yet.
# The dashboard's browser test (tests/e2e/test_dashboard.py) drives it; it runs this
# script itself when it finds no browser, and is skipped only when this fails.
# Prints the browser's path.
set -euo pipefail
find_browser() {
  for name in chromium chromium-browser chromium-headless-shell chrome-headless-shell; do
    if command -v "$name" >/dev/null 2>&1; then
      command -v "$name"
      return 0
    fi
  done
  for path in /usr/lib/chromium/chromium-headless-shell /usr/lib/chromium/chromium; do
    if [ -x "$path" ]; then
      echo "$path"
      return 0
    fi
  done
  return 1
}
if find_browser; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# Fonts too: without any, a screenshot's text is blank boxes.
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
find_browser
