"""The prefix cache on real processes: a prompt's cached prefix is reused, exactly.

Two meshes of the tiny model split over two nodes: one with the nodes' prefix
caches on, one with them off (the answer each prompt has alone). Prompts are
token ids, so their blocks (16 positions) are known.
"""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from prometheus_client.parser import text_string_to_metric_families

from meshnet.local_mesh import LocalMesh

BLOCK = 16


@pytest.fixture(scope="module")
def cached(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    return mesh_factory("0:2,2:4", model=tiny_path)


@pytest.fixture(scope="module")
def uncached(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    return mesh_factory("0:2,2:4", model=tiny_path, node_args=["--prefix-cache-mb", "0"])


def complete(
    mesh: LocalMesh,
    prompt: list[int],
    max_tokens: int = 8,
    headers: dict[str, str] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A completion as the mesh's tenant (or the one whose ``headers`` are given)."""
    body = {"model": "tiny", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens}
    r = httpx.post(
        f"{mesh.url}/v1/completions",
        json=body | fields,
        headers=headers or mesh.api_headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def tenant(mesh: LocalMesh, tenant_id: str) -> dict[str, str]:
    """The headers of a new tenant's API key."""
    admin = mesh.admin_headers
    r = httpx.post(f"{mesh.url}/admin/tenants", json={"id": tenant_id}, headers=admin)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{mesh.url}/admin/tenants/{tenant_id}/keys", headers=admin)
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


def cached_tokens(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def ids(reply: dict[str, Any]) -> list[int]:
    return list(reply["meshnet"]["ids"])


def node_counter(mesh: LocalMesh, node_id: str, name: str) -> float:
    """A node's metric, scraped through the tracker (the node tells its port first)."""
    deadline = time.monotonic() + 20
    while True:
        r = httpx.get(
            f"{mesh.url}/admin/nodes/{node_id}/metrics", headers=mesh.admin_headers, timeout=30
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name in (name, f"{name}_total"):
                return s.value
    raise AssertionError(f"{node_id} has no {name}")


def tracker_counter(mesh: LocalMesh, name: str) -> float:
    r = httpx.get(f"{mesh.url}/metrics", headers=mesh.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    return sum(
        s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name == f"{name}_total"
    )


def wait_idle(mesh: LocalMesh) -> None:
    """Until every node's heartbeat reports no sessions: routing weighs what a node
    reports, and a replica still reporting the last generation may lose to an idle one."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=30)
        if all(n["load"]["sessions"] == 0 for n in r.json()["nodes"]):
            return
        time.sleep(0.1)
    raise AssertionError("the nodes never went idle")


def prompt(seed: int, n: int, shared: list[int] | None = None) -> list[int]:
    """``n`` ids: ``shared`` first, then ids drawn from ``seed`` (within the tiny vocab)."""
    head = list(shared or [])
    tail = [(seed * 7919 + 31 * i) % 90 + 10 for i in range(n - len(head))]
    return head + tail


def test_a_shared_prefix_is_reused_and_the_answer_is_the_same(
    cached: LocalMesh, uncached: LocalMesh
) -> None:
    system = prompt(1, 5 * BLOCK + 3)  # 5 full blocks and a bit
    first, second = prompt(2, 110, system), prompt(3, 100, system)
    before = node_counter(cached, "node-1", "meshnet_node_prefix_reused_tokens")
    a = complete(cached, first)
    b = complete(cached, second)
    assert cached_tokens(a) == 0
    assert cached_tokens(b) == 5 * BLOCK  # the blocks whose ids are the same
    assert ids(a) == ids(complete(uncached, first))
    assert ids(b) == ids(complete(uncached, second))
    # every hop reused the same prefix: its KV of its own layers
    for node in ("node-0", "node-1"):
        reused = node_counter(cached, node, "meshnet_node_prefix_reused_tokens")
        assert reused - (before if node == "node-1" else 0) >= 5 * BLOCK
    # the same prompt again reuses every full block short of its last id
    again = complete(cached, second)
    assert cached_tokens(again) == (len(second) - 1) // BLOCK * BLOCK
    assert ids(again) == ids(b)


def test_a_prompt_sharing_only_its_first_block_reuses_only_that(
    cached: LocalMesh, uncached: LocalMesh
) -> None:
    base = prompt(4, 4 * BLOCK + 1)
    complete(cached, base)
    other = base[:BLOCK] + prompt(5, 3 * BLOCK + 1)[BLOCK:]  # differs from position 16 on
    reply = complete(cached, other)
    assert cached_tokens(reply) == BLOCK
    assert ids(reply) == ids(complete(uncached, other))


def test_eviction_under_a_small_kv_budget_keeps_answers_exact(
    mesh_factory: MeshFactory, tiny_path: Path, uncached: LocalMesh
) -> None:
    # 512 bytes a position on each node (2 layers, 2 KV heads of 16): a 120-id prompt's
    # session grows to about 100 KB, and its 7 blocks take 56 KB: 150 KB holds the
    # blocks of about one prompt beside a running one.
    small = mesh_factory("0:2,2:4", model=tiny_path, node_args=["--kv-budget-mb", str(150 / 1024)])
    prompts = [prompt(10 + i, 120) for i in range(4)]
    reused = []
    for p in [*prompts, prompts[3], prompts[0], prompts[1]]:
        reply = complete(small, p)  # never refused: cached blocks make way for sessions
        assert ids(reply) == ids(complete(uncached, p))
        reused.append(cached_tokens(reply))
    assert 0 < reused[4] <= 7 * BLOCK  # the last prompt again: what of it was kept
    assert reused[4] % BLOCK == 0
    assert reused[5] == 0  # the first one's were let go
    assert node_counter(small, "node-0", "meshnet_node_prefix_evicted_blocks") > 0
    held = node_counter(small, "node-0", "meshnet_node_prefix_cache_bytes")
    assert 0 < held <= 150 * 1024


def test_a_node_lost_after_a_cached_prefix_is_failed_over_exactly(
    mesh_factory: MeshFactory, tiny_factory: Any
) -> None:
    from streams import Streamed, serving, stream_completion

    long_tiny = Path(tiny_factory("long.gguf", context_length=1024))
    mesh = mesh_factory("0:2,2:4,2:4", model=long_tiny, heartbeat_timeout_s=8.0)
    body = {"model": "long", "prompt": prompt(21, 40), "max_tokens": 120, "seed": 3}
    body["temperature"] = 0.7
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    expected = r.json()["meshnet"]["ids"]
    assert len(expected) == 120
    killed: list[str] = []
    wait_idle(mesh)  # a node still reporting the first generation would weigh against it

    def kill(n: int, s: Streamed) -> None:
        if n == 20:
            killed.append(serving(s, (2, 4)))
            mesh.kill_node(killed[0])

    before = tracker_counter(mesh, "meshnet_prompt_tokens_cached")
    result = stream_completion(mesh, body, kill)
    assert result.error is None, result.error
    assert tracker_counter(mesh, "meshnet_prompt_tokens_cached") - before == 2 * BLOCK
    assert result.ids == expected  # the prefix was reused, a hop lost, the answer the same
    assert result.final is not None
    (recovery,) = result.final["recoveries"]
    assert recovery["failed_node"] == killed[0]


def test_a_sessions_first_turn_fills_the_cache_for_completions(
    cached: LocalMesh, uncached: LocalMesh
) -> None:
    from session_client import new_session, turn

    system = " ".join(f"rule {i}: answer in kind." for i in range(4))
    turn(cached, new_session(cached, system), "hi")
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "yo"}],
        "temperature": 0,
        "max_tokens": 6,
    }
    replies = [
        httpx.post(f"{m.url}/v1/chat/completions", json=body, headers=m.api_headers, timeout=120)
        for m in (cached, uncached)
    ]
    assert all(r.status_code == 200 for r in replies), replies[0].text
    assert cached_tokens(replies[0].json()) >= 2 * BLOCK  # the system prompt's blocks
    assert ids(replies[0].json()) == ids(replies[1].json())


def test_n_choices_compute_their_prompt_once(cached: LocalMesh, uncached: LocalMesh) -> None:
    """Choice 0's prefill fills the caches before the others open: they reuse its blocks."""
    body = {"model": "tiny", "prompt": prompt(77, 3 * BLOCK + 5), "max_tokens": 6, "n": 3}
    body |= {"temperature": 0.8, "seed": 5}

    def choices(mesh: LocalMesh) -> list[list[int]]:
        r = httpx.post(
            f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=120
        )
        assert r.status_code == 200, r.text
        return [c["meshnet"]["ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    before = tracker_counter(cached, "meshnet_prompt_tokens_cached")
    assert choices(cached) == choices(uncached)  # exact: what each choice gives uncached
    assert tracker_counter(cached, "meshnet_prompt_tokens_cached") - before == 2 * 3 * BLOCK


def test_a_sessions_first_turn_opens_on_a_cached_prefix(
    cached: LocalMesh, uncached: LocalMesh
) -> None:
    """A session whose system prompt a completion computed before starts on its blocks:
    the same ids as a cache-off mesh's session, turn after turn, those positions neither
    computed again nor billed."""
    from billing import billed, ledger
    from session_client import new_session, op, turn

    system = " ".join(f"policy {i}: keep to the facts given." for i in range(3))
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}],
        "temperature": 0,
        "max_tokens": 2,
    }
    r = httpx.post(f"{cached.url}/v1/chat/completions", json=body, headers=cached.api_headers)
    assert r.status_code == 200, r.text
    before = tracker_counter(cached, "meshnet_prompt_tokens_cached")

    def session(mesh: LocalMesh) -> list[dict[str, Any]]:
        sid = new_session(mesh, system)
        turns = [turn(mesh, sid, c, max_tokens=8) for c in ("hello there", "and then?")]
        assert op(mesh, sid, "evict")["state"] == "evicted"  # its KV to snapshot files
        return [*turns, turn(mesh, sid, "thanks", max_tokens=8)]

    first, second, third = session(cached)
    ref_first, ref_second, ref_third = session(uncached)
    reused = first["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert reused >= 2 * BLOCK and reused % BLOCK == 0  # the system prompt's blocks
    assert ref_first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert tracker_counter(cached, "meshnet_prompt_tokens_cached") - before == reused
    assert first["ids"] == ref_first["ids"]
    assert second["resume_path"] == "hot"  # its KV was kept between the turns
    assert second["ids"] == ref_second["ids"]
    # each hop billed the first turn's positions from the first it computed
    spans = billed(ledger(cached, first["turn_id"]))
    assert spans and all(ranges[0][0] == reused for ranges in spans.values()), spans
    # the prefix is a step of the session's history: a snapshot of it resumes exactly
    assert third["resume_path"] == "snapshot", third
    assert third["ids"] == ref_third["ids"]


def test_a_windowed_model_reuses_its_prefix_and_answers_the_same(
    mesh_factory: MeshFactory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A Gemma-3-shaped model (windows of 24 positions, wider than a block, in layers of
    both nodes), its prompts prefilled 32 rows a forward so the rings go round before a
    prompt ends: a prompt sharing a prefix, ending on either side of a window's edge,
    reuses its whole blocks and decodes the ids a cache-off mesh does."""
    from tinyarch import CASES, write_arch_gguf

    path = write_arch_gguf(tmp_path_factory.mktemp("win") / "g3.gguf", CASES["gemma3"], window=24)
    chunk = ["--prefill-chunk", "32"]
    on = mesh_factory("0:3,3:6", model=path, node_args=chunk)
    off = mesh_factory("0:3,3:6", model=path, node_args=[*chunk, "--prefix-cache-mb", "0"])

    def run(mesh: LocalMesh, ids: list[int]) -> dict[str, Any]:
        body = {"model": "g3", "prompt": ids, "temperature": 0, "max_tokens": 8}
        r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    base = prompt(31, 9 * BLOCK + 5)
    assert cached_tokens(run(on, base)) == 0
    for shared in (3 * BLOCK + 1, 4 * BLOCK + 9, 6 * BLOCK - 1):
        other = prompt(40 + shared, shared + 30, base[:shared])
        reply = run(on, other)
        assert cached_tokens(reply) == shared // BLOCK * BLOCK
        assert ids(reply) == ids(run(off, other))


def test_another_tenants_identical_prompt_is_not_a_hit(
    cached: LocalMesh, uncached: LocalMesh
) -> None:
    """The prefix cache is scoped per tenant: a second tenant sending the very prompt the
    first sent learns nothing (no cached tokens, its prefix computed on every hop); each
    tenant's own prompt again is a hit; the ids are the same every way."""
    other = tenant(cached, "prefix-other")
    ask = prompt(63, 4 * BLOCK + 7)  # a seed (mod 90) no other test of this mesh uses
    full = (len(ask) - 1) // BLOCK * BLOCK  # what a hit reuses: every full block but the last id
    want = ids(complete(uncached, ask))
    mine = complete(cached, ask)
    stored = node_counter(cached, "node-0", "meshnet_node_prefix_stored_blocks")
    theirs = complete(cached, ask, headers=other)
    assert cached_tokens(mine) == 0 and cached_tokens(theirs) == 0
    # the second tenant's prefill computed (and keeps, in its own scope) every block
    after = node_counter(cached, "node-0", "meshnet_node_prefix_stored_blocks")
    assert after - stored == len(ask) // BLOCK
    assert cached_tokens(complete(cached, ask)) == full  # each tenant's own: a hit
    assert cached_tokens(again := complete(cached, ask, headers=other)) == full
    assert ids(mine) == ids(theirs) == ids(again) == want
    # a cache_salt narrows the scope further: a hit only with the same salt
    salted = complete(cached, ask, cache_salt="s-1")
    assert cached_tokens(salted) == 0
    assert cached_tokens(complete(cached, ask, cache_salt="s-1")) == full
    assert cached_tokens(complete(cached, ask, headers=other, cache_salt="s-1")) == 0
    assert ids(salted) == want


def test_another_tenants_session_does_not_start_on_a_tenants_prefix(cached: LocalMesh) -> None:
    """A session is its tenant's: its first turn finds no prefix another tenant's
    completion left, and its own tenant's next session does find its blocks."""
    from session_client import TrackerApi, new_session, turn

    other = TrackerApi(cached.url, tenant(cached, "prefix-sessions"))
    system = " ".join(f"clause {i}: reply in one line." for i in range(4))
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}],
        "temperature": 0,
        "max_tokens": 2,
    }
    r = httpx.post(f"{cached.url}/v1/chat/completions", json=body, headers=cached.api_headers)
    assert r.status_code == 200, r.text
    theirs = turn(other, new_session(other, system), "hello")
    assert theirs["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = turn(other, new_session(other, system), "hello")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * BLOCK
    assert again["ids"] == theirs["ids"]


def test_sessions_on_one_system_prompt_hold_its_kv_once(
    cached: LocalMesh, uncached: LocalMesh
) -> None:
    """A second session's first turn reads the pages of the system prompt the first
    computed (kv/pages.py): its KV on every node is what follows them, not a copy."""
    from session_client import new_session, turn

    system = "".join(f"rule {i}: be exact and brief. " for i in range(6))  # ~170 ids

    def growth(mesh: LocalMesh) -> list[float]:
        """What each session's first turn added to the nodes' KV, in order."""
        nodes = ("node-0", "node-1")
        held = [sum(node_counter(mesh, n, "meshnet_node_kv_bytes") for n in nodes)]
        replies = []
        for _ in range(2):
            replies.append(turn(mesh, new_session(mesh, system), "hi")["ids"])
            held.append(sum(node_counter(mesh, n, "meshnet_node_kv_bytes") for n in nodes))
        assert replies[0] == replies[1]
        return [b - a for a, b in pairwise(held)]

    copies, shared = growth(uncached), growth(cached)
    assert copies[1] == copies[0] > 0  # a copy each
    assert shared[0] <= 1.1 * copies[0]  # the first computes it and holds it (in pages)
    assert 0 < shared[1] < 0.5 * copies[1]  # the second holds only what follows them
