"""Real ``redis-server`` processes on free loopback ports, for the benchmarks and the tests.

``RedisServer`` starts one standalone server (``--save "" --appendonly no``) and can kill, restart on the same
port, pause (SIGSTOP or ``CLIENT PAUSE``) and resume it. ``RedisClusterServers`` starts a 3-master cluster
(``--cluster-enabled yes`` + ``redis-cli --cluster create``). Everything started is killed by ``stop()``.
``redis_server()`` is the short form a benchmark uses: a private server for the length of a ``with``, its URL.
Needs the ``redis-server`` and ``redis-cli`` commands (and ``openssl`` for :class:`TlsFiles`), not redis-py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (nor on port + 10000, the cluster bus)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 < 65536 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair found")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ping(port: int, password: str | None = None, tls: TlsFiles | None = None) -> bool:
    """True when a RESP PING (after AUTH, if any) is answered."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            s = tls.client_context().wrap_socket(raw, server_hostname="127.0.0.1") if tls else raw
            if password:
                s.sendall(f"*2\r\n$4\r\nAUTH\r\n${len(password)}\r\n{password}\r\n".encode())
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    """A throw-away CA with a server and a client certificate (made with the ``openssl`` command)."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    @classmethod
    def create(cls, directory: Path) -> TlsFiles:
        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=directory, capture_output=True, check=True, timeout=60)

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvtier-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
        for name in ("server", "client"):
            run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-addext",
                "subjectAltName=IP:127.0.0.1", "-keyout", f"{name}.key", "-out", f"{name}.csr")
            run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-days", "1", "-out", f"{name}.crt", "-copy_extensions", "copy")
        d = str(directory)
        return cls(f"{d}/ca.crt", f"{d}/server.crt", f"{d}/server.key", f"{d}/client.crt", f"{d}/client.key")

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


class RedisServer:
    """One standalone (or cluster-node) redis-server on 127.0.0.1; TLS-only (client certificates required)
    when ``tls`` is given."""

    def __init__(self, port: int | None = None, *, password: str | None = None, maxmemory: str = "2gb",
                 extra: Sequence[str] = (), workdir: str | None = None, tls: TlsFiles | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self._port_fixed = port is not None
        self.maxmemory = maxmemory
        self.extra = list(extra)
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
                "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", self.tls.server_cert, "--tls-key-file", self.tls.server_key,
                     "--tls-ca-cert-file", self.tls.ca, "--tls-auth-clients", "yes"]
        return args + self.extra

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING. A port picked automatically that another process
        takes meanwhile is replaced by a fresh one (only before the first successful start: restarts keep it)."""
        for _ in range(5):
            if self._launch(timeout):
                self._port_fixed = True
                return self
            if self._port_fixed:
                break
            self.port = free_port()
        raise RuntimeError(f"redis-server on port {self.port} did not start: "
                           f"{(self.dir / 'server.log').read_text()[-2000:]}")

    def _launch(self, timeout: float) -> bool:
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(self.args(), stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            # the answer must come from our process, not from another test's server on a recycled port
            if _ping(self.port, self.password, self.tls) and self._is_ours(self.proc.pid):
                return True
            time.sleep(0.02)
        self.kill()
        return False

    def _is_ours(self, pid: int) -> bool:
        return f"process_id:{pid}" in self.cli("INFO", "server")

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        """Run ``redis-cli`` against this server and return its stdout."""
        cmd = [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port)]
        if self.tls:
            cmd += ["--tls", "--cacert", self.tls.ca, "--cert", self.tls.client_cert, "--key", self.tls.client_key]
        env = dict(os.environ)
        if self.password:
            env["REDISCLI_AUTH"] = self.password
        out = subprocess.run(cmd + list(args), capture_output=True, timeout=timeout, env=env, check=True)
        return out.stdout.decode()

    def kill(self) -> None:
        """SIGKILL the server (resuming it first if paused) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """Freeze the process (SIGSTOP): connections stay open, nothing is answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client_pause(self, seconds: float) -> None:
        """``CLIENT PAUSE`` every client (the server answers nothing until it ends)."""
        self.cli("CLIENT", "PAUSE", str(int(seconds * 1000)), "ALL")

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """A Redis Cluster of ``masters`` nodes (no replicas) on free loopback ports."""

    def __init__(self, masters: int = 3, *, maxmemory: str = "1gb") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
        self.nodes: list[RedisServer] = []
        for i in range(masters):
            node_dir = self.dir / f"n{i}"
            node_dir.mkdir()
            self.nodes.append(RedisServer(maxmemory=maxmemory, workdir=str(node_dir),
                                          extra=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                                 "--cluster-node-timeout", "5000"]))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        """Start every node, create the cluster and wait until every slot is served."""
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                           capture_output=True, timeout=timeout, check=True)
            deadline = time.monotonic() + timeout
            while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def redis_server(maxmemory: str = "2gb", timeout: float = 10.0) -> Iterator[str]:
    """Run a private standalone server (no persistence) on a free loopback port; yield its URL; kill it after."""
    if shutil.which(REDIS_SERVER) is None:
        raise RuntimeError("redis-server is not installed")
    server = RedisServer(maxmemory=maxmemory)
    try:
        yield server.start(timeout).url
    finally:
        server.stop()
