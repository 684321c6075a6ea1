"""Model paths confined to the allowed roots, and optional bearer API keys compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from pathlib import Path, PurePath

from app.errors import InvalidApiKey, InvalidRequest, ModelNotFound, ModelPathNotAllowed
from contracts import storage
from contracts.remote_models import bad_key, model_exists, remote_root_of, remote_roots
from contracts.savedmodel import SAVED_MODEL_FILE

NAME_MAX_BYTES = 255  # one path component (Linux, most file systems)
PATH_MAX_BYTES = 4096  # a whole path


def check_path_text(path: str, *, field: str, local: bool = True) -> None:
    """Refuse (``InvalidRequest`` naming ``field``) a path the file system cannot take: a NUL byte,
    text that is not UTF-8 (lone surrogates) and, for a ``local`` path, a component over 255 bytes
    or a path over 4096 bytes."""
    if "\x00" in path:
        raise InvalidRequest(f"{field}: contains a NUL byte; give a plain path", field=field)
    try:
        encoded = path.encode()
    except UnicodeEncodeError:
        raise InvalidRequest(f"{field}: is not valid UTF-8 text (lone surrogate); give a plain path",
                             field=field) from None
    if not local:
        return
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > NAME_MAX_BYTES:
        raise InvalidRequest(f"{field}: has a path component of {longest} bytes, longer than the file system "
                             f"allows ({NAME_MAX_BYTES}); use shorter names", field=field)
    if len(encoded) > PATH_MAX_BYTES:
        raise InvalidRequest(f"{field}: is {len(encoded)} bytes long, longer than the file system allows "
                             f"({PATH_MAX_BYTES}); use a shorter path", field=field)


def _roots_text(roots: Sequence[Path | str]) -> str:
    return ", ".join(repr(str(r)) for r in roots) or "(none configured: set JACOBIAN_MODEL_ROOTS)"


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def resolve_model_path(path: str, roots: Sequence[str], *, field: str = "model.path") -> Path | str:
    """The real path of a model directory (or ``.keras`` file), guaranteed to lie under one of ``roots``; for a
    model under an S3 root (``s3://bucket/prefix`` in ``roots``), its ``s3://`` URL.

    ``path`` is absolute (a local path, or an ``s3://`` URL under an S3 root), or relative to the roots: the local
    roots are tried first, in order, then the S3 roots (where a model exists: its ``.keras`` object or its
    ``saved_model.pb``); the first that exists wins. Symlinks are resolved before the check, so a link inside a
    root that points outside it is refused like any other escape. Raises ``ModelPathNotAllowed`` for ``..``
    components (and empty or ``.`` ones in a URL), paths outside the roots and symlink escapes, ``InvalidRequest``
    for an empty path or one the file system cannot take (``check_path_text``), ``OSError`` when an S3 root cannot
    be read. Existence is not checked here (see ``require_saved_model``), except with S3 roots, where a relative
    path found in no root is ``ModelNotFound`` (naming every place looked at).
    """
    if not path:
        raise InvalidRequest(f"{field}: give the SavedModel directory as a non-empty path", field=field)
    remote = storage.is_remote(path)
    check_path_text(path, field=field, local=not remote)
    local_roots = [Path(r).expanduser().resolve() for r in roots if not storage.is_remote(r)]
    s3_roots = remote_roots(roots)
    hint = f"give a path under one of the model roots: {_roots_text([*local_roots, *s3_roots])}"
    if remote:
        if remote_root_of(path, roots) is None:
            why = "has an empty, '.' or '..' component" if bad_key(path) else "is outside the model roots"
            raise ModelPathNotAllowed(f"{field}: {path!r} {why}; {hint}", field=field)
        return storage.normalize(path)
    pure = PurePath(path)
    if ".." in pure.parts:
        raise ModelPathNotAllowed(f"{field}: {path!r} contains '..', which is not allowed; {hint}", field=field)
    if not local_roots and not s3_roots:
        raise ModelPathNotAllowed(f"{field}: no model roots are configured; set JACOBIAN_MODEL_ROOTS", field=field)
    if pure.is_absolute() or not s3_roots:
        return _resolve_local(path, local_roots, field=field, hint=hint)
    local = _resolve_local(path, local_roots, field=field, hint=hint) if local_roots else None
    if local is not None and _exists(local):
        return local
    urls = [storage.join(root, *pure.parts) for root in s3_roots]
    found = next((url for url in urls if model_exists(url)), None)
    if found is not None:
        return found
    looked = ", ".join(repr(str(c)) for c in ([local] if local is not None else []) + urls)
    raise ModelNotFound(f"{field}: {path!r} is in none of the model roots (looked for {looked}); give the directory "
                        "of a SavedModel (the one that holds saved_model.pb) or a .keras file under a model root",
                        field=field)


def _resolve_local(path: str, real_roots: Sequence[Path], *, field: str, hint: str) -> Path:
    pure = PurePath(path)
    candidates = [Path(pure)] if pure.is_absolute() else [root / pure for root in real_roots]
    allowed: list[Path] = []
    escaped = False
    for cand in candidates:
        try:
            real = cand.resolve()
        except (OSError, RuntimeError):  # a symlink loop, or a component we may not read
            raise ModelNotFound(f"{field}: {path!r} cannot be resolved (symbolic link loop?); {hint}",
                                field=field) from None
        if _under(real, real_roots):
            allowed.append(real)
        elif _under(cand, real_roots) or not pure.is_absolute():
            escaped = True
    if not allowed:
        if escaped:
            raise ModelPathNotAllowed(
                f"{field}: {path!r} resolves (through a symbolic link) to a directory outside the "
                f"model roots; {hint}", field=field)
        raise ModelPathNotAllowed(f"{field}: {path!r} is outside the model roots; {hint}", field=field)
    for real in allowed:
        if _exists(real):
            return real
    return allowed[0]


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. ENAMETOOLONG once joined to a long root
        return False


def require_saved_model(model_dir: Path, *, field: str = "model.path") -> Path:
    """``model_dir`` if it holds a ``saved_model.pb``; raises ``ModelNotFound`` otherwise."""
    try:
        found = (model_dir / SAVED_MODEL_FILE).is_file()
    except OSError:  # e.g. ENAMETOOLONG once joined to a long root
        found = False
    if not found:
        what = "does not exist" if not _exists(model_dir) else f"has no {SAVED_MODEL_FILE}"
        raise ModelNotFound(f"{field}: {str(model_dir)!r} {what}; give the directory of a SavedModel "
                            "(the one that holds saved_model.pb)", field=field)
    return model_dir


def check_api_key(authorization: str | None, keys: Sequence[str]) -> str | None:
    """Accept ``Authorization: Bearer <key>`` for a configured key and return it; no keys configured means
    no auth (None).

    Each configured key is compared with ``hmac.compare_digest`` (all of them, always), so the
    time taken does not reveal how much of a key matched. Raises ``InvalidApiKey``.
    """
    if not keys:
        return None
    if not authorization:
        raise InvalidApiKey("Authorization: header missing; send 'Authorization: Bearer <api key>'",
                            field="Authorization")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise InvalidApiKey("Authorization: expected 'Bearer <api key>'", field="Authorization")
    given = token.encode()
    matched: str | None = None
    for key in keys:
        if hmac.compare_digest(given, key.encode()):
            matched = key
    if matched is None:
        raise InvalidApiKey("Authorization: unknown API key; ask an operator for a key in JACOBIAN_API_KEYS",
                            field="Authorization")
    return matched
