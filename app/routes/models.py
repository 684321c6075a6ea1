"""``GET /v1/models/signature``: a SavedModel's inputs, outputs and variables, read without TensorFlow."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from starlette.concurrency import run_in_threadpool

from app.deps import SettingsDep, require_api_key
from app.errors import InvalidRequest, ModelNotFound, NotReady, SignatureMismatch, error_responses
from app.security import require_saved_model, resolve_model_path
from contracts.graph_scan import scan_saved_model
from contracts.keras_file import KerasConfigTooLarge, KerasFileError, is_keras_file, read_keras_file, scan_keras_file
from contracts.remote_models import ModelTooLarge, remote_keras, remote_saved_model
from contracts.savedmodel import (
    SAVED_MODEL_FILE,
    SavedModelError,
    SavedModelInfo,
    Signature,
    SignatureNotFound,
    read_saved_model,
)

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=[Depends(require_api_key)],
                   responses=error_responses(401, 403, 404, 422, 429, 503))


def load_signature(path: str, signature: str, roots: list[str], *, op_allow: Mapping[str, list[str]],
                   path_field: str, signature_field: str) -> tuple[Path | str, SavedModelInfo, Signature]:
    """Resolve ``path`` under ``roots``, scan its graph (ops beyond the allowlist need ``op_allow`` for its
    root; a ``.keras`` file: its config, ``contracts.keras_file``) and read ``signature``; errors name
    ``path_field``/``signature_field``. A model under an S3 root is read from the bucket (``_read_remote``) and
    returned by its ``s3://`` URL.

    Raises ``ModelPathNotAllowed`` (403), ``ModelNotFound``, ``ModelRefused``, ``InvalidRequest`` or
    ``SignatureMismatch`` (422), ``NotReady`` (503) when an S3 root cannot be read.
    """
    try:
        resolved = resolve_model_path(path, roots, field=path_field)
    except OSError as exc:
        raise _unreadable(path, path_field, exc) from None
    if isinstance(resolved, str):
        model_dir, info = resolved, _read_remote(resolved, path_field, roots, op_allow)
    elif is_keras_file(resolved) and not resolved.is_dir():
        model_dir, info = resolved, _read_keras(resolved, path_field)
    else:
        model_dir = require_saved_model(resolved, field=path_field)
        try:
            scan_saved_model(model_dir, op_allow=op_allow, roots=roots, field=path_field)
            info = read_saved_model(model_dir)
        except SavedModelError as exc:
            raise ModelNotFound(f"{path_field}: {exc}; export the model with tf.saved_model.save or "
                                "keras Model.export", field=path_field) from None
    try:
        return model_dir, info, info.signature(signature)
    except SignatureNotFound as exc:
        raise SignatureMismatch(f"{signature_field}: {exc}", field=signature_field) from None


def _read_keras(path: Path, field: str) -> SavedModelInfo:
    """Scan and read the ``.keras`` file at ``path`` (the settings say which custom objects and which unsafe
    roots); raises ``ModelNotFound`` for a file that is missing or not a ``.keras`` zip, ``ModelRefused``."""
    from contracts.settings import get_settings

    settings = get_settings()
    try:
        scan_keras_file(path, custom_objects=settings.keras_custom_objects,
                        unsafe_roots=settings.keras_unsafe_roots, field=field)
        return read_keras_file(path)
    except KerasFileError as exc:
        raise ModelNotFound(f"{field}: {exc}; save the model with keras Model.save('model.keras')",
                            field=field) from None


def _read_remote(url: str, field: str, roots: list[str], op_allow: Mapping[str, list[str]]) -> SavedModelInfo:
    """Scan and read the model at ``url`` under an S3 root by bounded reads (``contracts.remote_models``)."""
    from contracts.settings import get_settings

    settings = get_settings()
    keras = is_keras_file(url)
    try:
        if keras:
            return remote_keras(url, custom_objects=settings.keras_custom_objects,
                                unsafe_roots=settings.keras_unsafe_roots, max_bytes=settings.max_model_read_bytes,
                                field=field)
        return remote_saved_model(url, op_allow=op_allow, roots=roots, max_bytes=settings.max_model_read_bytes,
                                  field=field)
    except FileNotFoundError:
        what = "is not an object in the bucket" if keras else f"has no {SAVED_MODEL_FILE} in the bucket"
        raise ModelNotFound(f"{field}: {url!r} {what}; give the prefix of a SavedModel (the one that holds "
                            f"{SAVED_MODEL_FILE}) or a .keras object under an S3 model root", field=field) from None
    except (ModelTooLarge, KerasConfigTooLarge) as exc:
        message = str(exc) if str(exc).startswith(f"{field}: ") else f"{field}: {exc}"
        raise InvalidRequest(message, field=field) from None
    except SavedModelError as exc:
        fix = "save the model with keras Model.save('model.keras')" if keras else \
            "export the model with tf.saved_model.save or keras Model.export"
        raise ModelNotFound(f"{field}: {exc}; {fix}", field=field) from None
    except OSError as exc:
        raise _unreadable(url, field, exc) from None


def _unreadable(path: str, field: str, exc: OSError) -> NotReady:
    return NotReady(f"{field}: the model store cannot be read for {path!r} ({type(exc).__name__}: {exc}); retry "
                    "later, or ask the operator to check the S3 model root and the service's credentials")


@router.get("/signature")
async def get_signature(
    settings: SettingsDep,
    path: Annotated[str, Query(description="SavedModel directory or .keras file, absolute (a local path, or "
                                           "an s3:// URL under an S3 model root) or relative to a model root")],
    signature: Annotated[str, Query(description="signature name")] = "serving_default",
) -> dict[str, Any]:
    """Inputs and outputs of one signature (``{name: {dtype, shape}}``, ``None`` = unknown size) and
    the model's variables, which ``wrt`` names as ``"variables/<name>"``."""
    model_dir, info, _ = await run_in_threadpool(load_signature, path, signature, settings.model_roots,
                                                 op_allow=settings.model_op_allow, path_field="path",
                                                 signature_field="signature")
    return {
        "path": str(model_dir),
        "signature": signature,
        "signatures": [s for s in info.signatures if not s.startswith("__")],
        **info.describe(signature),
    }
