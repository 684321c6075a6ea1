#!/usr/bin/env bash
# The one test command: set up (scripts/setup.sh), then every suite (unit, integration, e2e).
#
#   bash scripts/test.sh                      # all of tests/
#   bash scripts/test.sh -k signature -x      # options go to pytest, still over all of tests/
#   bash scripts/test.sh tests/unit           # paths given replace the default tests/
#   bash scripts/test.sh --faults             # only the network-fault tests (marker 'faults': network
#                                             # namespaces, root)
#   bash scripts/test.sh --no-faults          # everything but them (a quicker local run; CI runs them)
#
# The network-fault tests (tests/integration/test_network_faults.py, about 7 minutes) need root and network
# namespaces; where the kernel or permissions forbid them they skip with the reason, and this script
# prints a WARNING line saying so. The plain command (.ci/run's) runs them with the rest.
# First `uv lock --check`: a uv.lock out of date with pyproject.toml fails the run (and CI, which runs this).
# pytest's exit code is passed through, except 5 (no tests collected), which fails: a run that
# collected nothing must not look green. JACOBIAN_SKIP_SETUP=1 skips the lock check and scripts/setup.sh.
# The set-up installs Debian's `prometheus` (prometheus and promtool) when missing: the metrics tests
# scrape the service with a real Prometheus. JACOBIAN_SETUP_PROMETHEUS=0 leaves it out (those tests
# then fail and say so). Likewise Debian's `chromium` for the /ui browser test (JACOBIAN_SETUP_CHROMIUM=0
# leaves it out; that test then fails and says so).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ "${JACOBIAN_SKIP_SETUP:-0}" == 1 ]]; then
  echo "[test] JACOBIAN_SKIP_SETUP=1: not running scripts/setup.sh (nor the uv.lock check)"
else
  echo "[test] uv lock --check"
  bash scripts/uv.sh lock --check || {
    echo "[test] ERROR: uv.lock is out of date with pyproject.toml: run 'bash scripts/uv.sh lock' and commit uv.lock" >&2
    exit 1
  }
  JACOBIAN_SETUP_PROMETHEUS="${JACOBIAN_SETUP_PROMETHEUS:-1}" \
    JACOBIAN_SETUP_CHROMIUM="${JACOBIAN_SETUP_CHROMIUM:-1}" \
    JACOBIAN_SETUP_IPTABLES="${JACOBIAN_SETUP_IPTABLES:-1}" bash scripts/setup.sh
fi

PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || { echo "[test] ERROR: $PY missing: run bash scripts/setup.sh" >&2; exit 1; }

# --faults: the network-fault tests alone; --no-faults: all but them; otherwise everything (unless -m is given).
marker=()
args=()
for arg in "$@"; do
  case "$arg" in
    --faults) marker=(-m faults) ;;
    --no-faults) marker=(-m "not faults") ;;
    -m|-m*) marker=(); args+=("$arg") ;;
    *) args+=("$arg") ;;
  esac
done
set -- "${args[@]+"${args[@]}"}"

# Run all of tests/ unless a path (or node id) is among the arguments.
targets=(tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    targets=()
    break
  fi
done

log="$(mktemp "${TMPDIR:-/tmp}/jacobian-pytest.XXXXXX")"
trap 'rm -f "$log"' EXIT

echo "[test] $PY -m pytest ${targets[*]:+${targets[*]} }-q -p no:cacheprovider -ra ${marker[*]:+${marker[*]} }$*"
set +e
"$PY" -m pytest "${targets[@]}" -q -p no:cacheprovider -ra "${marker[@]}" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if grep -q "network namespaces unavailable\|tc netem unavailable" "$log"; then
  grep -o "\(network namespaces\|tc netem\) unavailable: .*" "$log" | sort -u | sed 's/^/[test] WARNING: skipped: /' >&2
fi

# One closing line in the plain 'N passed, N failed, N skipped' form (errors count as failed).
counts="$("$PY" - "$log" <<'PY'
import re
import sys

lines = open(sys.argv[1], errors="replace").read().splitlines()
final = next((l for l in reversed(lines) if re.search(r"\b(passed|failed|errors?|skipped|no tests ran)\b.* in [0-9.]+s", l)), "")
n = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", final)}
print(n.get("passed", 0) + n.get("xpassed", 0), n.get("failed", 0) + n.get("error", 0) + n.get("errors", 0),
      n.get("skipped", 0) + n.get("xfailed", 0))
PY
)" || counts="0 0 0"
read -r passed failed skipped <<<"$counts"

case "$rc" in
  0) verdict="OK" ;;
  5) verdict="FAILED: pytest collected no tests (exit 5); a run that collected nothing is not a pass"; rc=1 ;;
  *) verdict="FAILED: pytest exit code $rc" ;;
esac
[[ "$rc" -eq 0 ]] || echo "[test] $verdict" >&2
echo "summary: $passed passed, $failed failed, $skipped skipped"
exit "$rc"
