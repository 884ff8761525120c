"""A minimal RESP2 client over a raw non-blocking socket, for moving large values fast.

redis-py (even with hiredis) turns every bulk reply into a ``bytes`` object that must then be copied again into
a tensor. ``RespConnection`` instead reads a bulk value straight into a caller-supplied buffer with
``recv_into`` and writes records with scatter-gather ``sendmsg`` (header, payload and framing without joining).
It speaks only what the Redis tier needs: AUTH / SELECT at connect, pipelined GET and SET, line replies.

Every wait for the socket is bounded by ``timeout`` (the time allowed without progress); a timeout or any
socket error raises and the connection must be dropped (``close``), since the stream is then out of sync.
``RespPool`` keeps up to ``size`` connections to one address and drops a connection whose user raised.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

_BUF = 16 * 1024  # small: bytes read ahead into it are copied once more, so large values bypass it
_IOV_MAX = 512


class RespError(Exception):
    """An error reply from the server (``-ERR ...``, ``-MOVED ...``, ``-WRONGPASS ...``)."""


class RespProtocolError(ConnectionError):
    """The byte stream is not valid RESP: the connection cannot be used any more."""


def pack(*args: bytes | str | int) -> bytes:
    """Encode one command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RespConnection:
    """One connection. Not safe for concurrent use: a pool hands it to one task at a time."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self.timeout = timeout
        self._buf = bytearray(_BUF)
        self._view = memoryview(self._buf)
        self._pos = 0
        self._end = 0
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int, *, timeout: float, connect_timeout: float,
                   username: str | None = None, password: str | None = None, db: int = 0) -> RespConnection:
        """Connect, authenticate and select the database."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(connect_timeout):
                await loop.sock_connect(sock, (host, port))
            conn = cls(sock, timeout)
            async with asyncio.timeout(connect_timeout):
                if password:
                    await conn.command(*(("AUTH", username, password) if username else ("AUTH", password)))
                if db:
                    await conn.command("SELECT", db)
        except BaseException:
            sock.close()
            raise
        return conn

    def healthy(self) -> bool:
        """Idle and still open: no unread bytes and the server has not closed its end (one non-blocking peek)."""
        if self.closed or self._pos != self._end:
            return False
        try:
            self._sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False  # EOF, or bytes nobody asked for

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()

    # -- commands ----------------------------------------------------------------------------------------------

    async def command(self, *args: bytes | str | int) -> Any:
        """Send one small command and return its reply (bytes, int, str or None); error replies raise."""
        await self.send([pack(*args)])
        return await self.read_reply()

    async def read_reply(self) -> Any:
        """Read one non-array reply. A bulk string is returned as bytes (use ``read_line`` for large ones)."""
        line = await self.read_line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = bytearray(n)
            await self.read_into(memoryview(data))
            await self.skip(2)
            return bytes(data)
        raise RespProtocolError(f"unexpected reply type {kind!r}")

    # -- writing -----------------------------------------------------------------------------------------------

    async def send(self, parts: Sequence[Any]) -> None:
        """Write every buffer in order with as few ``sendmsg`` calls as the kernel allows."""
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        i = 0
        while i < len(views):
            try:
                sent = self._sock.sendmsg(views[i:i + _IOV_MAX])
            except (BlockingIOError, InterruptedError):
                await self._wait(writer=True)
                continue
            while sent and i < len(views):
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0

    # -- reading -----------------------------------------------------------------------------------------------

    async def read_line(self) -> bytes:
        """One CRLF-terminated line, without the CRLF."""
        while True:
            idx = self._buf.find(b"\r\n", self._pos, self._end)
            if idx >= 0:
                line = bytes(self._view[self._pos:idx])
                self._pos = idx + 2
                return line
            await self._fill()

    async def read_into(self, out: memoryview) -> None:
        """Fill ``out`` exactly: buffered bytes first, then straight from the socket into ``out``."""
        need = out.nbytes
        have = min(need, self._end - self._pos)
        if have:
            out[:have] = self._view[self._pos:self._pos + have]
            self._pos += have
        off = have
        while off < need:
            off += await self._recv_into(out[off:])

    async def skip(self, n: int) -> None:
        """Discard the next ``n`` bytes of the stream."""
        while n > 0:
            have = min(n, self._end - self._pos)
            self._pos += have
            n -= have
            if n:
                await self._fill()

    async def _fill(self) -> None:
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):
            if self._pos == 0:
                raise RespProtocolError("reply line longer than the read buffer")
            rest = self._end - self._pos
            self._view[:rest] = self._view[self._pos:self._end]
            self._pos, self._end = 0, rest
        self._end += await self._recv_into(self._view[self._end:])

    async def _recv_into(self, out: memoryview) -> int:
        while True:
            try:
                n = self._sock.recv_into(out)
            except (BlockingIOError, InterruptedError):
                await self._wait(writer=False)
                continue
            if n == 0:
                raise ConnectionResetError("redis closed the connection")
            return n

    async def _wait(self, *, writer: bool) -> None:
        """Wait until the socket is readable / writable, at most ``timeout`` seconds."""
        if self.closed:
            raise ConnectionError("connection closed")
        fut: asyncio.Future[None] = self._loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        def expire() -> None:
            if not fut.done():
                fut.set_exception(TimeoutError(f"redis did not respond within {self.timeout}s"))

        add, remove = ((self._loop.add_writer, self._loop.remove_writer) if writer
                       else (self._loop.add_reader, self._loop.remove_reader))
        add(self._fd, ready)
        timer = self._loop.call_later(self.timeout, expire)
        try:
            await fut
        finally:
            timer.cancel()
            remove(self._fd)


class RespPool:
    """Up to ``size`` connections to one server; ``connection()`` lends one for the duration of a block."""

    def __init__(self, host: str, port: int, size: int, **open_kw: Any) -> None:
        self.host, self.port = host, port
        self._open_kw = open_kw
        self._sem = asyncio.Semaphore(max(1, size))
        self._idle: list[RespConnection] = []

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[RespConnection]:
        """Lend a connection; one whose user raised (timeout, error, cancel) is closed, not reused."""
        async with self._sem:
            conn = self._idle.pop() if self._idle else None
            while conn is not None and not conn.healthy():  # closed by a server restart or idle timeout
                conn.close()
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = await RespConnection.open(self.host, self.port, **self._open_kw)
            try:
                yield conn
            except BaseException:
                conn.close()
                raise
            self._idle.append(conn)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
