#!/usr/bin/env bash
# Render a lagom-tune report in headless Chromium and save a screenshot to look at.
#   bash bench/check_report.sh REPORT.html [SHOT.png]
# Needs Debian's chromium (apt-get install chromium); tests/test_report.py does the same when it is installed.
set -euo pipefail
report=$(realpath "$1"); shot=${2:-report.png}
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --window-size=1200,2400 \
  --screenshot="$shot" "file://$report"
echo "screenshot: $shot"
