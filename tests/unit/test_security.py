"""app.security: model paths stay under the allowed roots; API keys are checked in constant time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app import security
from app.errors import InvalidApiKey, InvalidRequest, ModelNotFound, ModelPathNotAllowed, status_of
from app.security import check_api_key, require_saved_model, resolve_model_path


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """roots/a/model, roots/b/other, outside/secret, and links in root a."""
    root_a, root_b, outside = tmp_path / "roots" / "a", tmp_path / "roots" / "b", tmp_path / "outside"
    for d in (root_a / "model", root_b / "other", outside / "secret"):
        d.mkdir(parents=True)
        (d / "saved_model.pb").write_bytes(b"")
    (root_a / "escape").symlink_to(outside / "secret")
    (root_a / "inner").symlink_to(root_a / "model")
    (root_a / "to_b").symlink_to(root_b / "other")
    return {"a": root_a, "b": root_b, "outside": outside, "tmp": tmp_path}


def test_absolute_and_relative_paths_inside_roots(tree):
    roots = [str(tree["a"]), str(tree["b"])]
    assert resolve_model_path(str(tree["a"] / "model"), roots) == tree["a"] / "model"
    assert resolve_model_path("model", roots) == tree["a"] / "model"
    assert resolve_model_path("other", roots) == tree["b"] / "other"  # second root, where it exists
    assert resolve_model_path("./model/", roots) == tree["a"] / "model"


def test_symlinks_inside_the_roots_are_followed(tree):
    roots = [str(tree["a"]), str(tree["b"])]
    assert resolve_model_path("inner", roots) == tree["a"] / "model"
    assert resolve_model_path("to_b", roots) == tree["b"] / "other"


def test_root_given_through_a_symlink(tree):
    link = tree["tmp"] / "root_link"
    link.symlink_to(tree["a"])
    assert resolve_model_path(str(link / "model"), [str(link)]) == tree["a"] / "model"
    assert resolve_model_path("model", [str(link)]) == tree["a"] / "model"


@pytest.mark.parametrize("path", ["../outside/secret", "model/../../outside/secret", "/etc/../etc", ".."])
def test_dotdot_is_refused(tree, path):
    with pytest.raises(ModelPathNotAllowed, match=r"model\.path: .*'\.\.'"):
        resolve_model_path(path, [str(tree["a"])])


def test_absolute_escape_is_refused(tree):
    with pytest.raises(ModelPathNotAllowed, match="outside the model roots"):
        resolve_model_path(str(tree["outside"] / "secret"), [str(tree["a"])])
    with pytest.raises(ModelPathNotAllowed):
        resolve_model_path("/etc", [str(tree["a"])])


@pytest.mark.parametrize("relative", [True, False])
def test_symlink_escape_is_refused(tree, relative):
    path = "escape" if relative else str(tree["a"] / "escape")
    with pytest.raises(ModelPathNotAllowed, match="symbolic link"):
        resolve_model_path(path, [str(tree["a"])])


def test_root_prefix_is_not_a_parent(tree):
    """``/roots/a`` must not admit ``/roots/ab`` (string-prefix bug)."""
    sibling = tree["a"].parent / "ab"
    sibling.mkdir()
    with pytest.raises(ModelPathNotAllowed):
        resolve_model_path(str(sibling), [str(tree["a"])])


def test_no_roots_and_empty_paths(tree):
    with pytest.raises(ModelPathNotAllowed, match="JACOBIAN_MODEL_ROOTS"):
        resolve_model_path("model", [])
    with pytest.raises(InvalidRequest):
        resolve_model_path("", [str(tree["a"])])
    with pytest.raises(InvalidRequest):
        resolve_model_path("mo\x00del", [str(tree["a"])])


def test_field_name_is_in_the_message(tree):
    with pytest.raises(ModelPathNotAllowed, match="^path: "):
        resolve_model_path("/etc", [str(tree["a"])], field="path")


def test_require_saved_model(tree):
    assert require_saved_model(tree["a"] / "model") == tree["a"] / "model"
    with pytest.raises(ModelNotFound, match="does not exist"):
        require_saved_model(tree["a"] / "missing")
    empty = tree["a"] / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFound, match="has no saved_model.pb"):
        require_saved_model(empty)


def test_no_keys_means_no_auth():
    check_api_key(None, [])
    check_api_key("Bearer anything", [])


@pytest.mark.parametrize("header,match", [
    (None, "header missing"),
    ("", "header missing"),
    ("Basic a2V5", "expected 'Bearer"),
    ("Bearer", "expected 'Bearer"),
    ("Bearer wrong", "unknown API key"),
    ("Bearer key-1x", "unknown API key"),
    ("Bearer key-", "unknown API key"),
])
def test_bad_keys_are_refused(header, match):
    with pytest.raises(InvalidApiKey, match=match):
        check_api_key(header, ["key-1", "key-2"])


def test_good_keys_pass():
    check_api_key("Bearer key-2", ["key-1", "key-2"])
    check_api_key("bearer   key-1 ", ["key-1", "key-2"])


def test_keys_compared_with_compare_digest_against_every_key(monkeypatch):
    calls = []
    real = security.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    check_api_key("Bearer key-1", ["key-1", "key-2", "key-3"])
    assert len(calls) == 3  # no early exit on the first match


def test_status_codes_of_security_errors():
    assert status_of(ModelPathNotAllowed("x")) == 403
    assert status_of(InvalidApiKey("x")) == 401
    assert status_of(ModelNotFound("x")) == 422
    assert status_of(RuntimeError("x")) == 500


def test_symlink_loop_is_refused(tree):
    loop = tree["a"] / "loop"
    os.symlink(loop, loop)
    with pytest.raises(ModelNotFound, match="cannot be resolved"):
        resolve_model_path("loop", [str(tree["a"])])
