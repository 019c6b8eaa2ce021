"""This host's room for a node: memory for its layers and KV budget, disk for parked KV."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from meshnet.node.preflight.model import ModelFacts
from meshnet.node.preflight.result import Check, fail, ok, size, skip

MIN_PARK_FREE = 64 << 20  # free disk a node wants for parking when its KV budget is unlimited


def check_memory(facts: ModelFacts | None, kv_budget: int, meminfo: str = "/proc/meminfo") -> Check:
    """The node's layers and KV budget against the memory available to it."""
    available = available_memory(meminfo)
    if available is None:
        return skip("memory", "cannot tell the memory available here")
    weights = facts.weight_bytes if facts else 0
    need = weights + kv_budget
    what = f"layers {size(weights)} + KV {_kv_detail(kv_budget, facts)}"
    if need > available:
        fix = "serve fewer layers (--layers), lower --kv-budget-mb, or free memory"
        return fail("memory", f"{what} > {size(available)} available", fix)
    return ok("memory", f"{what} of {size(available)} available")


def _kv_detail(kv_budget: int, facts: ModelFacts | None) -> str:
    """The KV budget, and how many positions (of all sequences together) it holds."""
    if not kv_budget:
        return "unlimited"
    per_token = facts.kv_bytes_per_token if facts else 0
    return (
        f"{size(kv_budget)} ({kv_budget // per_token} positions)" if per_token else size(kv_budget)
    )


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable, narrowed by this process's cgroup (v2) limit when it has one."""
    try:
        fields = dict(line.split(":", 1) for line in Path(meminfo).read_text().splitlines())
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, max(0, int(limit) - used))
    return available


def check_park_dir(park_dir: str | None, kv_budget: int) -> Check:
    """Parked KV needs a writable directory with room for the hot KV (or ``MIN_PARK_FREE``)."""
    target = Path(park_dir) if park_dir else Path(tempfile.gettempdir())
    existing = next((p for p in (target, *target.parents) if p.exists()), None)
    flag = "--park-dir" if park_dir else "--park-dir (default: the temp directory)"
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        return fail("park dir", f"{target} cannot be written", f"{flag} DIR this user can write")
    need = max(kv_budget, MIN_PARK_FREE)
    free = shutil.disk_usage(existing).free
    if free < need:
        return fail("park dir", f"{size(free)} free on {target}", f"{flag} on a disk with more")
    return ok("park dir", f"{target}: {size(free)} free (wants {size(need)})")
