#!/usr/bin/env bash
# CI as it runs: .ci/run in a fresh clone of this repository's HEAD, then the clone is deleted (each one holds a
# ~2 GB virtual environment; clones left behind in /tmp once filled the disk CI ran on).
set -euo pipefail
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
git clone -q "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" "$dir"
(cd "$dir" && bash .ci/run)
