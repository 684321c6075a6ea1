#!/usr/bin/env bash
# Idempotent setup of a development / CI machine for the Jacobian service.
#
#   bash scripts/setup.sh [--with-prometheus] [--with-chromium] [--extras worker,test] [--force]
#
# 1. .venv with Python >= 3.11 (python3.11, else python3), created when missing;
# 2. pip upgraded, then `pip install -e '.[worker,test]'`; skipped when .venv/.jacobian-setup
#    records the same pyproject.toml and extras and the editable install still points here;
# 3. redis-server from Debian's packages when it is not on PATH (the tests start their own);
# 4. Debian's `prometheus` (server and promtool) only with --with-prometheus or
#    JACOBIAN_SETUP_PROMETHEUS=1; scripts/test.sh sets it (the metrics tests run a real Prometheus);
# 5. Debian's `chromium` only with --with-chromium or JACOBIAN_SETUP_CHROMIUM=1; scripts/test.sh sets it
#    (the /ui test drives a headless Chromium).
#
# Environment: PYTHON (interpreter used to create .venv), JACOBIAN_SETUP_EXTRAS,
# JACOBIAN_SETUP_PROMETHEUS=1, JACOBIAN_SETUP_CHROMIUM=1, JACOBIAN_SETUP_FORCE=1 (reinstall even when up to date).
set -euo pipefail
set -o errtrace  # the ERR trap below also fires inside functions

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
STAMP="$VENV/.jacobian-setup"
EXTRAS="${JACOBIAN_SETUP_EXTRAS:-worker,test}"
WITH_PROMETHEUS="${JACOBIAN_SETUP_PROMETHEUS:-0}"
WITH_CHROMIUM="${JACOBIAN_SETUP_CHROMIUM:-0}"
FORCE="${JACOBIAN_SETUP_FORCE:-0}"

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
trap 'printf "[setup] FAILED (exit %s) at line %s: %s\n" "$?" "$LINENO" "$BASH_COMMAND" >&2' ERR

usage() { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --with-prometheus) WITH_PROMETHEUS=1 ;;
    --with-chromium) WITH_CHROMIUM=1 ;;
    --extras) [[ $# -ge 2 ]] || die "--extras needs a value, e.g. --extras worker,test"; EXTRAS="$2"; shift ;;
    --extras=*) EXTRAS="${1#--extras=}" ;;
    --force) FORCE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see: bash scripts/setup.sh --help)" ;;
  esac
  shift
done

# --- system packages (Debian) ------------------------------------------------------------------
APT_UPDATED=0
as_root() {
  if [[ "$(id -u)" -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    if [[ -t 0 ]]; then sudo "$@"; else sudo -n "$@"; fi
  else
    die "need root to run '$*': run as root or install sudo"
  fi
}
apt_install() {
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found: install $* with your system's package manager"
  if [[ "$APT_UPDATED" -eq 0 ]]; then
    log "apt-get update"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
    APT_UPDATED=1
  fi
  log "apt-get install -y $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

if command -v redis-server >/dev/null 2>&1; then
  log "redis-server present: $(command -v redis-server)"
else
  apt_install redis-server
  command -v redis-server >/dev/null 2>&1 || die "redis-server still not on PATH after apt-get install"
fi

case "$WITH_PROMETHEUS" in
  1|true|yes)
    if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
      log "prometheus present: $(command -v prometheus), $(command -v promtool)"
    else
      apt_install prometheus
      command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 \
        || die "prometheus or promtool still not on PATH after apt-get install prometheus"
    fi ;;
  0|false|no|"") ;;
  *) die "JACOBIAN_SETUP_PROMETHEUS must be 0 or 1, got '$WITH_PROMETHEUS'" ;;
esac

case "$WITH_CHROMIUM" in
  1|true|yes)
    if command -v chromium >/dev/null 2>&1; then
      log "chromium present: $(command -v chromium)"
    else
      apt_install chromium
      command -v chromium >/dev/null 2>&1 || die "chromium still not on PATH after apt-get install chromium"
    fi ;;
  0|false|no|"") ;;
  *) die "JACOBIAN_SETUP_CHROMIUM must be 0 or 1, got '$WITH_CHROMIUM'" ;;
esac

# --- virtual environment ------------------------------------------------------------------------
pick_python() {
  local candidate
  for candidate in ${PYTHON:-} python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 \
       && "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

if [[ -x "$VENV/bin/python" ]]; then
  "$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die "$VENV/bin/python does not run or is older than Python 3.11: remove .venv and run this again"
  log "virtualenv present: .venv ($("$VENV/bin/python" -V 2>&1))"
else
  [[ ! -e "$VENV" ]] || die "$VENV exists but has no bin/python: remove it and run this again"
  PY="$(pick_python)" || die "no Python >= 3.11 found (tried: ${PYTHON:-} python3.11 python3); set PYTHON=/path/to/python3.11"
  log "creating .venv with $PY ($("$PY" -V 2>&1))"
  "$PY" -m venv "$VENV"
fi

# --- project install ----------------------------------------------------------------------------
pyproject_sha() { sha256sum pyproject.toml | cut -d' ' -f1; }

# True when the stamp records this pyproject.toml and (at least) the wanted extras.
stamp_covers() {
  [[ -f "$STAMP" ]] || return 1
  local sha="" extras="" key value extra
  while IFS='=' read -r key value; do
    case "$key" in pyproject_sha256) sha="$value" ;; extras) extras="$value" ;; esac
  done < "$STAMP"
  [[ "$sha" == "$(pyproject_sha)" ]] || return 1
  for extra in ${EXTRAS//,/ }; do
    [[ ",$extras," == *",$extra,"* ]] || return 1
  done
}

# True when the editable install points at this checkout and every requirement of the wanted
# extras is installed (names only; versions were resolved by pip when the stamp was written).
install_is_current() {
  "$VENV/bin/python" -I - "$ROOT" "$EXTRAS" <<'PY'
import importlib.metadata as md
import json
import re
import sys
from pathlib import Path

root, extras = sys.argv[1], {e.strip() for e in sys.argv[2].split(",") if e.strip()}
try:
    dist = md.distribution("jacobian-service")
except md.PackageNotFoundError:
    sys.exit("jacobian-service is not installed in .venv")
direct = json.loads(dist.read_text("direct_url.json") or "{}")
if direct.get("url") != Path(root).as_uri() or not direct.get("dir_info", {}).get("editable"):
    sys.exit(f"jacobian-service in .venv is not an editable install of {root}")
missing = []
for req in dist.requires or []:
    name, _, marker = req.partition(";")
    extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
    if extra and extra.group(1) not in extras:
        continue
    if "python_version" in marker or "sys_platform" in marker:
        continue  # none in this project; keep the check simple rather than evaluate markers
    base = re.split(r"[\s\[<>=!~(]", name.strip(), maxsplit=1)[0]
    try:
        md.distribution(base)
    except md.PackageNotFoundError:
        missing.append(base)
if missing:
    sys.exit("missing in .venv: " + ", ".join(missing))
PY
}

if [[ "$FORCE" != 1 ]] && stamp_covers && reason="$(install_is_current 2>&1)"; then
  log "project up to date in .venv (extras: $EXTRAS); JACOBIAN_SETUP_FORCE=1 reinstalls"
else
  if [[ "$FORCE" == 1 ]]; then log "installing: forced (JACOBIAN_SETUP_FORCE=1 or --force)"
  elif [[ -n "${reason:-}" ]]; then log "installing: $reason"
  else log "installing: no record of an install of this pyproject.toml with extras '$EXTRAS'"
  fi
  rm -f "$STAMP"
  log "upgrading pip"
  "$VENV/bin/python" -m pip install --upgrade --quiet pip
  log "pip install -e '.[$EXTRAS]' (TensorFlow takes about a minute on a fresh machine)"
  "$VENV/bin/python" -m pip install --progress-bar off -e ".[$EXTRAS]"
  reason="$(install_is_current 2>&1)" || die "install incomplete after pip install: $reason"
  printf 'pyproject_sha256=%s\nextras=%s\n' "$(pyproject_sha)" "$EXTRAS" > "$STAMP"
fi

[[ -x "$VENV/bin/jacobian" ]] || die ".venv/bin/jacobian is missing: check [project.scripts] in pyproject.toml"
log "done: .venv/bin/python, .venv/bin/jacobian, $(command -v redis-server)"
