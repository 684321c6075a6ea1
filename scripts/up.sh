#!/usr/bin/env bash
# The one command for the local stack: set up (scripts/setup.sh), then `jacobian up`:
# redis-server when none is reachable, the API on http://127.0.0.1:8000 and one worker;
# results under ./var/results, models under ./var/models. Arguments go to `jacobian up`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh
mkdir -p var/results var/models
[[ -x .venv/bin/jacobian ]] || { echo "[up] ERROR: .venv/bin/jacobian missing after setup" >&2; exit 1; }
echo "[up] exec .venv/bin/jacobian up $*"
exec .venv/bin/jacobian up "$@"
