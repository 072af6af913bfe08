#!/usr/bin/env bash
# Installs the peer tools the `peers` benchmark compares casckpt with (benchmarks/peers.py):
# restic and borg, from the distribution's packages (Debian/Ubuntu: apt-get; needs root and
# the network). Does nothing when both are already on PATH. casckpt itself never installs them.
set -euo pipefail
if command -v restic >/dev/null && command -v borg >/dev/null; then
    exit 0
fi
apt-get update
apt-get install -y --no-install-recommends restic borgbackup
restic version
borg --version
