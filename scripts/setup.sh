#!/usr/bin/env bash
# Idempotent setup of a development / CI machine for the Jacobian service.
#
#   bash scripts/setup.sh [--with-prometheus] [--with-chromium] [--extras api,worker,test] [--force]
#
# 1. redis-server from Debian's packages when it is not on PATH (the tests start their own);
# 2. Debian's `prometheus` (server and promtool) only with --with-prometheus or
#    JACOBIAN_SETUP_PROMETHEUS=1; scripts/test.sh sets it (the metrics tests run a real Prometheus);
# 3. Debian's `chromium` only with --with-chromium or JACOBIAN_SETUP_CHROMIUM=1; scripts/test.sh sets it
#    (the /ui test drives a headless Chromium);
# 4. uv (pinned; scripts/uv.sh installs it from PyPI when missing), then `uv sync --locked` with the
#    extras: .venv (Python 3.11, created when missing) gets exactly the versions in uv.lock and the
#    project as an editable install (.venv/bin/jacobian), bytecode compiled when packages changed.
#    Fast when nothing changed; it fails when uv.lock is out of date with pyproject.toml
#    (`bash scripts/uv.sh lock` updates it).
#
# Environment: PYTHON (interpreter used to create .venv), JACOBIAN_SETUP_EXTRAS (default api,worker,test),
# JACOBIAN_SETUP_PROMETHEUS=1, JACOBIAN_SETUP_CHROMIUM=1, JACOBIAN_SETUP_FORCE=1 (reinstall every package),
# UV / JACOBIAN_UV_DIR (which uv: see scripts/uv.sh).
set -euo pipefail
set -o errtrace  # the ERR trap below also fires inside functions

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="$ROOT/.venv"
EXTRAS="${JACOBIAN_SETUP_EXTRAS:-api,worker,test}"
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
    --extras) [[ $# -ge 2 ]] || die "--extras needs a value, e.g. --extras api,worker,test"; EXTRAS="$2"; shift ;;
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

# iptables for the network-fault tests (scripts/test.sh sets JACOBIAN_SETUP_IPTABLES=1); without it they
# partition by taking a veth end down instead.
if [[ "${JACOBIAN_SETUP_IPTABLES:-0}" == 1 ]] && ! command -v iptables >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1; then
  apt_install iptables || log "iptables could not be installed: the network-fault tests take a veth end down instead"
fi

# --- virtual environment and project install (uv, from uv.lock) ---------------------------------
# A Python 3.11 to 3.13 (what requires-python and the lock cover); 3.11 first, the version the tests run on.
python_ok() { "$1" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else 1)' 2>/dev/null; }
pick_python() {
  local candidate
  for candidate in ${PYTHON:-} python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

sync_args=(sync --locked)
for extra in ${EXTRAS//,/ }; do
  sync_args+=(--extra "$extra")
done
first_args=()
if [[ -x "$VENV/bin/python" ]]; then
  python_ok "$VENV/bin/python" \
    || die "$VENV/bin/python does not run or is not Python 3.11 to 3.13: remove .venv and run this again"
  log "virtualenv present: .venv ($("$VENV/bin/python" -V 2>&1))"
else
  [[ ! -e "$VENV" ]] || die "$VENV exists but has no bin/python: remove it and run this again"
  PY="$(pick_python)" \
    || die "no Python 3.11 to 3.13 found (tried: ${PYTHON:-} python3.11 python3); set PYTHON=/path/to/python3.11"
  log "creating .venv with $PY ($("$PY" -V 2>&1))"
  first_args+=(--python "$PY")
fi
if [[ "$FORCE" == 1 ]]; then first_args+=(--reinstall); fi
rm -f "$VENV/.jacobian-setup"  # the install stamp of the pip-based set-up: uv sync checks the venv itself

UV_BIN="$(bash "$ROOT/scripts/uv.sh" --path)"
uv_sync() { UV_PROJECT_ENVIRONMENT="$VENV" UV_PYTHON_DOWNLOADS=never "$UV_BIN" "${sync_args[@]}" "$@"; }
# When uv adds, removes or replaces a package, site-packages (the folder) changes; nothing else does.
site_packages_state() { stat -c '%y' "$VENV"/lib/python3*/site-packages 2>/dev/null || true; }

log "uv sync --locked (extras: $EXTRAS) with $UV_BIN ($("$UV_BIN" --version))"
# .venv holds exactly the lock's packages for these extras (others are removed); the project is an
# editable install. No managed Python is downloaded: the interpreter comes from this machine.
before="$(site_packages_state)"
uv_sync "${first_args[@]}" \
  || die "uv sync failed; if uv.lock is out of date with pyproject.toml, run 'bash scripts/uv.sh lock' and commit uv.lock"
if [[ "$(site_packages_state)" != "$before" ]]; then
  # As pip did: compiled once here, not by every process. With PYTHONDONTWRITEBYTECODE=1 (as in CI) each
  # process would compile TensorFlow's modules again (import tensorflow: 17-21 s instead of 8 s on 2 cores).
  # Only after a change: a no-op re-run skips checking every .pyc (about 2 s).
  log "compiling bytecode"
  uv_sync --compile-bytecode --quiet || die "uv sync --compile-bytecode failed"
fi

# The project's own modules too: an editable install's sources are not the packages uv compiles, and with
# PYTHONDONTWRITEBYTECODE=1 every process compiled them again (72 modules, 0.19 s of a warm `jacobian compute` of a
# small model, 2-core Xeon). Every run: up to date, it only compares timestamps (0.13 s).
"$VENV/bin/python" -m compileall -q -j 0 contracts jacobian app worker >/dev/null \
  || die "compiling the project's bytecode failed (python -m compileall contracts jacobian app worker)"

[[ -x "$VENV/bin/jacobian" ]] || die ".venv/bin/jacobian is missing: check [project.scripts] in pyproject.toml"
log "done: .venv/bin/python, .venv/bin/jacobian, $(command -v redis-server)"
