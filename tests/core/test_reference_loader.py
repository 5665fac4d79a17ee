"""Where SGLang's wheel comes from (``twin/reference/sglang_wheel.py``): a download is announced
before it starts and not retried after it failed; ``TWIN_OFFLINE=1`` and a missing
``TWIN_SGLANG_WHEEL`` never download. No network: ``pip`` is replaced by a stand-in."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from twin.reference import sglang_wheel


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """Every ``pip download`` the loader runs, answered with a failure."""
    calls: list[list[str]] = []

    def run(cmd: list[str], **_kw: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network here")

    monkeypatch.setattr(sglang_wheel.subprocess, "run", run)
    monkeypatch.delenv("TWIN_SGLANG_WHEEL", raising=False)
    monkeypatch.delenv("TWIN_OFFLINE", raising=False)
    monkeypatch.setenv("TWIN_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def test_a_download_is_announced_first_and_not_retried_after_it_failed(
        fake_pip: list[list[str]], tmp_path: Path) -> None:
    heard: list[str] = []

    def note(text: str) -> None:
        assert not fake_pip, "announced after pip ran"
        heard.append(text)

    with pytest.raises(sglang_wheel.ReferenceUnavailable, match="could not download"):
        sglang_wheel.wheel_path(note)
    assert len(heard) == 1 and "downloading sglang==0.5.23" in heard[0]
    assert str(tmp_path / "cache") in heard[0]
    assert len(fake_pip) == 2 and fake_pip[0][2:4] == ["pip", "download"]
    with pytest.raises(sglang_wheel.ReferenceUnavailable, match="not retried"):
        sglang_wheel.load(note)
    assert len(fake_pip) == 2 and len(heard) == 1


def test_offline_or_a_named_wheel_never_downloads(fake_pip: list[list[str]],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("TWIN_OFFLINE", "1")
    with pytest.raises(sglang_wheel.ReferenceUnavailable, match="TWIN_OFFLINE=1"):
        sglang_wheel.wheel_path()
    monkeypatch.delenv("TWIN_OFFLINE")
    monkeypatch.setenv("TWIN_SGLANG_WHEEL", str(tmp_path / "none.whl"))
    with pytest.raises(sglang_wheel.ReferenceUnavailable, match="no such file"):
        sglang_wheel.wheel_path()
    bad = tmp_path / "sglang-0.5.23-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    monkeypatch.setenv("TWIN_SGLANG_WHEEL", str(bad))
    with pytest.raises(sglang_wheel.ReferenceUnavailable, match="not a usable sglang wheel"):
        sglang_wheel.load()
    assert fake_pip == []
