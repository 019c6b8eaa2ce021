"""The serving benchmarks' pure parts: rates from streamed arrivals, the delay bound,
the comparison rows, llama-server's command line; and the delay proxy on loopback."""

import socket
import threading
from pathlib import Path

import pytest

from meshnet.benchmark.comparison import Comparison, best
from meshnet.benchmark.delay_proxy import DelayProxy, parse_pairs
from meshnet.benchmark.llama_server import server_argv
from meshnet.benchmark.mesh_delay import bound_tok_s, links_per_token
from meshnet.benchmark.quiet import (
    Measured,
    ProcTimes,
    Quiet,
    busy_share,
    cpu_times,
    parse_proc_stat,
    tree_jiffies,
)
from meshnet.benchmark.streams import (
    StreamRecord,
    _is_token,
    decode_tok_s,
    end_to_end_tok_s,
    steady_tok_s,
)
from meshnet.errors import MeshnetError
from meshnet.local_mesh import free_port


def _record(sent: float, arrivals: list[float], tokens: int | None = None) -> StreamRecord:
    return StreamRecord(sent, tuple(arrivals), tokens or len(arrivals), "length")


def test_decode_rate_counts_the_tokens_after_the_first() -> None:
    # the first token at t=1 carries the prefill; 4 more in the next 2 s
    assert decode_tok_s(_record(0.0, [1.0, 1.5, 2.0, 2.5, 3.0])) == pytest.approx(2.0)


def test_decode_rate_takes_the_servers_token_count_over_the_chunks() -> None:
    # two chunks, but the server says they held 5 tokens
    assert decode_tok_s(_record(0.0, [1.0, 3.0], tokens=5)) == pytest.approx(2.0)


def test_one_token_has_no_decode() -> None:
    with pytest.raises(MeshnetError):
        decode_tok_s(_record(0.0, [1.0]))


def test_steady_rate_counts_every_stream_while_all_decode() -> None:
    a = _record(0.0, [1.0, 2.0, 3.0, 4.0, 5.0])
    b = _record(0.0, [2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 9.0])  # starts late, ends late
    # window (2, 5]: a has 3, 4, 5; b has 2.5, 3, 3.5, 4, 4.5
    assert steady_tok_s([a, b]) == pytest.approx(8 / 3)


def test_streams_that_never_overlap_have_no_steady_window() -> None:
    with pytest.raises(MeshnetError):
        steady_tok_s([_record(0.0, [1.0, 2.0]), _record(0.0, [3.0, 4.0])])


def test_end_to_end_rate_includes_the_wait_for_the_first_token() -> None:
    records = [_record(0.0, [1.0, 2.0]), _record(1.0, [3.0, 4.0])]
    assert end_to_end_tok_s(records) == pytest.approx(4 / 4.0)


def test_token_chunks_are_told_from_opening_and_closing_ones() -> None:
    opening = {"meshnet": {"route": []}}
    assert not _is_token(opening, {"text": "", "finish_reason": None})
    assert _is_token({"meshnet": {"ids": [5]}}, {"text": "", "finish_reason": None})
    assert _is_token({}, {"text": " the", "finish_reason": None})
    assert not _is_token({}, {"text": "", "finish_reason": "length"})


def test_a_ring_token_crosses_one_link_per_hop_and_a_star_two() -> None:
    assert links_per_token(3, relay=True) == 3  # 0 -> 1 -> 2, and the token 2 -> 0
    assert links_per_token(1, relay=True) == 0  # one node feeds itself
    assert links_per_token(3, relay=False) == 6


def test_the_bound_adds_each_links_delay_to_compute() -> None:
    assert bound_tok_s(20.0, 4, 10.0) == pytest.approx(1000 / 60)
    assert bound_tok_s(20.0, 4, 0.0) == pytest.approx(50.0)


def test_a_latency_goal_is_a_ceiling_a_rate_goal_a_floor() -> None:
    latency = Comparison("ms", 23.0, 20.0, "one node", 1.15, "lower")
    assert latency.ratio == pytest.approx(1.15) and latency.meets_goal
    assert not Comparison("ms", 24.0, 20.0, "one node", 1.15, "lower").meets_goal
    rate = Comparison("tok/s", 30.0, 20.0, "peer", 2.0)
    assert rate.ratio == pytest.approx(1.5) and rate.meets_goal is False
    alone = Comparison("tok/s", 30.0, None, "peer", 2.0)
    assert alone.ratio is None and alone.meets_goal is None
    assert "NOT met" in rate.line() and "met" in latency.line()


def test_the_best_round_is_the_fastest() -> None:
    assert best([3.0, 5.0, 4.0]) == 5.0
    assert best([3.0, 5.0, 4.0], "lower") == 3.0
    with pytest.raises(ValueError):
        best([])


def test_llama_server_gets_a_context_for_every_slot() -> None:
    argv = server_argv(Path("/b"), Path("/m.gguf"), 8080, threads=2, slots=8, slot_ctx=256)
    assert argv[0] == "/b/llama-server"
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert flags == {
        "-m": "/m.gguf",
        "--host": "127.0.0.1",
        "--port": "8080",
        "-t": "2",
        "-np": "8",
        "-c": "2048",
    }


def test_busy_share_is_non_idle_time_over_all_time() -> None:
    #          user nice system idle iowait irq softirq steal guest guest_nice
    before = cpu_times("cpu  100 0 50 800 50 0 0 0 10 0\ncpu0 1 2 3 4\n")
    after = cpu_times("cpu  130 0 60 850 60 0 0 0 20 0\n")
    assert before == (150, 1000)  # guest time is inside user: not counted twice
    assert busy_share(before, after) == pytest.approx(40 / 100)
    assert busy_share(after, after) == 0.0


def test_a_process_stat_line_parses_whatever_its_name_holds() -> None:
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime ...
    line = "42 (a (b) c) S 7 42 42 0 -1 0 0 0 0 0 120 30 5 6 20 0 1 0\n"
    assert parse_proc_stat(line) == ProcTimes(ppid=7, own=150, reaped=11)


def test_our_cpu_time_is_the_tree_under_us_and_what_it_reaped() -> None:
    procs = {
        1: ProcTimes(0, 1000, 0),  # init: not ours
        10: ProcTimes(1, 5, 40),  # us; 40 from children already waited for
        11: ProcTimes(10, 100, 0),  # a server we started
        12: ProcTimes(11, 7, 0),  # its child
        20: ProcTimes(1, 300, 0),  # a neighbour
    }
    assert tree_jiffies(procs, 10) == 5 + 40 + 100 + 7
    assert tree_jiffies(procs, 99) == 0


def test_figures_come_from_undisturbed_tries_where_there_are_any() -> None:
    quiet = Quiet(threshold=0.1)
    tries = [Measured(90.0, 0.5), Measured(70.0, 0.05), Measured(60.0, 0.0)]
    assert quiet.best(tries) == (70.0, True)
    assert quiet.best(tries, "lower") == (60.0, True)
    assert quiet.best([Measured(90.0, 0.5), Measured(80.0, 0.3)]) == (90.0, False)


def test_a_disturbed_measurement_is_taken_again_up_to_the_retries(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import meshnet.benchmark.quiet as quiet_module

    shares = iter([0.5, 0.4, 0.02, 0.9])
    monkeypatch.setattr(quiet_module, "wait_idle", lambda *a: None)
    monkeypatch.setattr(quiet_module, "others_share", lambda b, a: next(shares))
    runs = iter([1.0, 2.0, 3.0, 4.0])
    tries = Quiet(retries=2).measure(lambda: next(runs))
    assert tries == [Measured(1.0, 0.5), Measured(2.0, 0.4), Measured(3.0, 0.02)]
    assert Quiet(retries=0).measure(lambda: next(runs)) == [Measured(4.0, 0.9)]


def test_proxy_pairs_parse() -> None:
    assert parse_pairs(["9001=8001", "9002=8002"]) == [(9001, 8001), (9002, 8002)]


def _echo_server(port: int) -> socket.socket:
    """A server on 127.0.0.1:``port`` that sends back what its one connection sends."""
    server = socket.create_server(("127.0.0.1", port))

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    return server


def _round_trip(host: str, port: int, payload: bytes) -> bytes:
    with socket.create_connection((host, port)) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += s.recv(1 << 16)
    return got


def test_the_delay_proxy_forwards_every_byte_and_holds_them() -> None:
    target = free_port()
    server = _echo_server(target)
    listen = free_port()
    proxy = DelayProxy([(listen, target)])
    try:
        proxy.set_delay(20.0)
        payload = bytes(range(256)) * 400
        assert _round_trip("127.0.0.1", listen, payload) == payload
        assert proxy.held_ms() >= 20.0  # never sooner than asked
    finally:
        proxy.close()
        server.close()


def test_the_delay_proxy_takes_its_targets_port_on_another_loopback_address() -> None:
    """A node's relay port is offered by number: its forwarder listens on that number."""
    port = free_port()
    server = _echo_server(port)
    proxy = DelayProxy([(port, port)], host="127.0.0.2")
    try:
        proxy.set_delay(5.0)
        assert _round_trip("127.0.0.2", port, b"relay frame") == b"relay frame"
        assert proxy.held_ms() >= 5.0
    finally:
        proxy.close()
        server.close()
