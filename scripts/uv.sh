#!/usr/bin/env bash
# The project's pinned uv (uv.lock is written and read with it), installed from PyPI when missing:
#
#   bash scripts/uv.sh lock            # after editing the dependencies in pyproject.toml; commit uv.lock
#   bash scripts/uv.sh lock --check    # fails when uv.lock is stale (scripts/test.sh runs it)
#   bash scripts/uv.sh --path          # print the path of the uv executable
#
# Which uv: $UV when set; else `uv` on PATH when it is version $JACOBIAN_UV_VERSION; else
# $JACOBIAN_UV_DIR/bin/uv (default ~/.cache/jacobian/uv-<version>), installed there when missing with
# `python -m pip install --target` (the index pip is configured with, PyPI by default; no other network).
# PYTHON names the interpreter whose pip installs it (else python3.11, python3).
set -euo pipefail

VERSION="${JACOBIAN_UV_VERSION:-0.13.9}"
DIR="${JACOBIAN_UV_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/jacobian/uv-$VERSION}"

die() { printf '[uv] ERROR: %s\n' "$*" >&2; exit 1; }

version_of() { "$1" --version 2>/dev/null | awk '{print $2}'; }

find_uv() {
  if [[ -n "${UV:-}" ]]; then
    [[ -x "$UV" ]] || die "UV=$UV is not an executable"
    printf '%s\n' "$UV"
    return 0
  fi
  local on_path
  on_path="$(command -v uv 2>/dev/null || true)"
  if [[ -n "$on_path" && "$(version_of "$on_path")" == "$VERSION" ]]; then
    printf '%s\n' "$on_path"
    return 0
  fi
  if [[ -x "$DIR/bin/uv" && "$(version_of "$DIR/bin/uv")" == "$VERSION" ]]; then
    printf '%s\n' "$DIR/bin/uv"
    return 0
  fi
  return 1
}

install_uv() {
  local py="" pip=() candidate tmp
  mkdir -p "$(dirname "$DIR")"
  tmp="$(mktemp -d "$DIR.tmp.XXXXXX")"
  for candidate in ${PYTHON:-} python3.11 python3; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -m pip --version >/dev/null 2>&1; then
      py="$candidate"; pip=("$candidate" -m pip)
      break
    fi
    # No pip (Debian without python3-pip): a throwaway venv has one (ensurepip, python3-venv).
    if [[ -z "$py" ]] && "$candidate" -m venv "$tmp/.venv" >/dev/null 2>&1; then
      py="$candidate"; pip=("$tmp/.venv/bin/python" -m pip)
      break
    fi
  done
  [[ -n "$py" ]] || { rm -rf "$tmp"; die "no python with pip or venv found (tried: ${PYTHON:-} python3.11 python3) \
to install uv $VERSION; install python3-pip, or install uv $VERSION yourself and set UV=/path/to/uv"; }
  printf '[uv] installing uv %s into %s (pip install --target, with %s)\n' "$VERSION" "$DIR" "$py" >&2
  # Into a fresh folder, then renamed: a concurrent set-up never sees a half-installed uv.
  if ! PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \
      "${pip[@]}" install --quiet --target "$tmp/uv" "uv==$VERSION" >&2; then
    rm -rf "$tmp"
    die "pip install uv==$VERSION failed (see above)"
  fi
  rm -rf "$DIR"
  mv "$tmp/uv" "$DIR" 2>/dev/null || true  # another set-up may have won the race: keep its copy
  rm -rf "$tmp"
  [[ -x "$DIR/bin/uv" ]] || die "uv $VERSION installed, but $DIR/bin/uv is missing"
}

uv_path="$(find_uv)" || { install_uv; uv_path="$(find_uv)" || die "uv $VERSION not found after installing it"; }

if [[ "${1:-}" == "--path" ]]; then
  printf '%s\n' "$uv_path"
  exit 0
fi
exec "$uv_path" "$@"
