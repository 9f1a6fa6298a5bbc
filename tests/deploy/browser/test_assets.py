"""onnxruntime-web's files: checked by SHA-256, installed with npm, never from a CDN."""

import pytest

from fedlang.deploy.browser import assets


def test_files_of_another_version_count_as_missing(tmp_path):
    for name in assets.FILES:
        (tmp_path / name).write_bytes(b"not onnxruntime-web " + name.encode())
    assert assets.missing(tmp_path) == list(assets.FILES)


def test_installing_without_npm_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="Expected npm"):
        assets.install(tmp_path / "ort", npm="/nonexistent/npm")


def test_installed_files_are_not_fetched_again(ort_assets):
    assert assets.install(ort_assets, npm="/nonexistent/npm") == ort_assets
