#!/usr/bin/env bash
# Installs what the studio's browser test needs: headless Chromium and its
# WebDriver (Debian packages chromium and chromium-driver), when missing and
# when running as root with apt-get. Quick when they are there.
set -euo pipefail
if command -v chromedriver >/dev/null && { command -v chromium >/dev/null || command -v chromium-browser >/dev/null; }; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  echo "setup-browser: installing chromium and chromium-driver" >&2
  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null; }
else
  echo "setup-browser: chromium/chromedriver missing; install the Debian packages chromium and chromium-driver" >&2
  exit 1
fi
