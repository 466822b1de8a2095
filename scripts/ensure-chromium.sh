#!/usr/bin/env bash
# Make sure headless Chromium and its WebDriver are there for the browser test.
#
# The status page's test drives Debian's `chromium` through `chromedriver`.
# When either is missing and we are root on Debian/Ubuntu, both are installed
# from the distribution's packages. Otherwise this only warns: the browser
# test then fails (it never skips) and says what is missing.
set -euo pipefail

chromium="${DEFERRED_CHROMIUM:-/usr/bin/chromium}"
driver="${DEFERRED_CHROMEDRIVER:-/usr/bin/chromedriver}"

if [ -x "$chromium" ] && [ -x "$driver" ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Chromium or chromedriver is missing: installing Debian's chromium and chromium-driver..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium chromium-driver >/dev/null
else
    echo "Chromium ($chromium) or chromedriver ($driver) is missing: the browser test will" >&2
    echo "fail. Install them (e.g. 'sudo apt-get install chromium chromium-driver')." >&2
fi
