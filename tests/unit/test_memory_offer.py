"""A node offers the memory its host has available, within its own cap less what the
process already holds; nothing where it cannot tell."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshnet.node import memory_offer
from meshnet.node.memory_offer import offered_memory, resident_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")


def _statm(tmp_path: Path, resident_pages: int) -> str:
    path = tmp_path / "statm"
    path.write_text(f"9999 {resident_pages} 10 1 0 50 0\n")
    return str(path)


def test_without_a_cap_the_hosts_available_memory_is_offered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(memory_offer, "available_memory", lambda: 8 << 30)
    assert offered_memory(0, _statm(tmp_path, 100)) == 8 << 30


def test_a_cap_offers_what_the_process_leaves_of_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(memory_offer, "available_memory", lambda: 8 << 30)
    statm = _statm(tmp_path, 1000)
    assert resident_bytes(statm) == 1000 * PAGE
    assert offered_memory(1 << 30, statm) == (1 << 30) - 1000 * PAGE
    assert offered_memory(100 * PAGE, statm) == 0  # already past its cap
    monkeypatch.setattr(memory_offer, "available_memory", lambda: 5 * PAGE)
    assert offered_memory(1 << 30, statm) == 5 * PAGE  # the host has less than the cap


def test_a_host_that_does_not_say_offers_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(memory_offer, "available_memory", lambda: None)
    assert offered_memory(0) == 0
    assert resident_bytes(str(tmp_path / "missing")) == 0
