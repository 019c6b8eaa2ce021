"""A TCP forwarder that holds every byte for a fixed delay: ``tc netem`` in user space.

Used by ``bench/mesh_delay.py`` where the kernel has no ``sch_netem``. Each
listening address forwards to one target; each direction of each connection
is a FIFO in which what was read at time t is written at t + delay, so
messages keep their order and several can be on the wire at once, as on a
link with that one-way latency (no bandwidth limit, no loss).

Run as a process of its own (so its event loop competes with nobody's GIL):

    python -m meshnet.benchmark.delay_proxy [--host HOST] LISTEN_PORT=TARGET_PORT ...

It listens on HOST (default 127.0.0.1), forwards to 127.0.0.1, and prints
``ready`` once every port listens. On another loopback address (127.0.0.2) it
can listen on a port number its target uses: a node offers its relay port by
number, so the port's forwarder must listen on that number. Commands on stdin,
one per line, each answered on stdout:

- ``delay SECONDS`` -> ``ok``: the delay of everything read from now on;
- ``held`` -> ``held MEAN_S COUNT``: the mean time chunks were actually held
  (the asked delay plus the event loop's lateness) since the last ``held``.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from meshnet.errors import MeshnetError

_CHUNK = 1 << 16
LOOPBACK = "127.0.0.1"  # where targets are, and by default where it listens
_MODULE = "meshnet.benchmark.delay_proxy"


@dataclass
class _State:
    delay_s: float = 0.0
    held_s: float = 0.0  # total hold of the chunks counted
    chunks: int = 0


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, state: _State) -> None:
    """Copy ``src`` to ``dst``, each chunk written ``state.delay_s`` after it was read."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, float, bytes]] = asyncio.Queue()

    async def writer() -> None:
        while True:
            read_at, due, data = await queue.get()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if not data:
                break
            dst.write(data)
            state.held_s += loop.time() - read_at
            state.chunks += 1
            await dst.drain()

    task = asyncio.create_task(writer())
    try:
        while data := await src.read(_CHUNK):
            now = loop.time()
            queue.put_nowait((now, now + state.delay_s, data))
        now = loop.time()
        queue.put_nowait((now, now + state.delay_s, b""))  # the close is delayed too
        await task
    except (ConnectionError, OSError):
        task.cancel()
    finally:
        dst.close()


async def _serve(host: str, listen: int, target: int, state: _State) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, target)
        except OSError:
            writer.close()
            return
        pumps = asyncio.gather(_pump(reader, up_writer, state), _pump(up_reader, writer, state))
        with contextlib.suppress(asyncio.CancelledError):  # the proxy is shutting down
            await pumps

    return await asyncio.start_server(handle, host, listen)


async def _commands(state: _State) -> None:
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        words = line.split()
        if words[:1] == ["delay"] and len(words) == 2:
            state.delay_s = float(words[1])
            print("ok", flush=True)
        elif words == ["held"]:
            mean = state.held_s / state.chunks if state.chunks else 0.0
            print(f"held {mean:.6f} {state.chunks}", flush=True)
            state.held_s, state.chunks = 0.0, 0
        else:
            print(f"error unknown command {line.strip()!r}", flush=True)


async def _main(host: str, pairs: list[tuple[int, int]]) -> None:
    state = _State()
    servers = [await _serve(host, listen, target, state) for listen, target in pairs]
    print("ready", flush=True)
    try:
        await _commands(state)  # stdin closed: the parent is done with us
    finally:
        for s in servers:
            s.close()


def parse_pairs(args: list[str]) -> list[tuple[int, int]]:
    """``["9001=8001", ...]`` -> ``[(9001, 8001), ...]``."""
    pairs = []
    for a in args:
        listen, _, target = a.partition("=")
        pairs.append((int(listen), int(target)))
    return pairs


class DelayProxy:
    """The parent's handle on a running proxy process; ``close()`` ends it."""

    def __init__(self, pairs: Sequence[tuple[int, int]], host: str = LOOPBACK) -> None:
        argv = [sys.executable, "-m", _MODULE, "--host", host]
        argv += [f"{listen}={target}" for listen, target in pairs]
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        try:
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    def _ask(self, command: str) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def _answer(self) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line or line.startswith("error"):
            raise MeshnetError(f"the delay proxy failed: {line or 'it exited'}")
        return line

    def _expect(self, word: str) -> None:
        if (line := self._answer()) != word:
            raise MeshnetError(f"the delay proxy said {line!r}, not {word!r}")

    def set_delay(self, delay_ms: float) -> None:
        """Every forwarded byte's delay from now on, each direction."""
        if self._ask(f"delay {delay_ms / 1000:.6f}") != "ok":
            raise MeshnetError("the delay proxy did not take the delay")

    def held_ms(self) -> float:
        """Mean hold per chunk since the last call: the delay as the links really had it."""
        return float(self._ask("held").split()[1]) * 1000

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()  # the proxy ends when its stdin does
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


def _cli(argv: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """``[--host HOST] LISTEN=TARGET ...`` -> (host, pairs)."""
    if argv[:1] == ["--host"] and len(argv) >= 2:
        return argv[1], parse_pairs(argv[2:])
    return LOOPBACK, parse_pairs(argv)


if __name__ == "__main__":
    asyncio.run(_main(*_cli(sys.argv[1:])))
