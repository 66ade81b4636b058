"""A slow data source for DataCache: Python's ``http.server`` in its own network namespace, reached
over an emulated rate-limited link, the way training data on a public cloud sits on a networked file
system behind the node's NIC (Shi et al., section 4.1).

:class:`FileServer` builds, like :mod:`.netemu` (whose public helpers it reuses), two namespaces
joined by one veth pair, both ends born in their namespaces (nothing is added to the root
namespace)::

    namespace scfs<pid>-<n>-srv:  "fs-srv" 10.214.0.1/30  (tbf: server -> client)  python -m http.server
    namespace scfs<pid>-<n>-cli:  "fs-cli" 10.214.0.2/30  (tbf: client -> server)

The addresses are private, distinct from netemu's 10.213.x.x, and exist only inside these two
namespaces, so concurrent servers never collide and no traffic can leave them. Clients live in the
root namespace: :meth:`FileServer.client` returns a :class:`FileClient` whose connections are opened
from inside the client namespace (the opening thread alone switches with ``setns(2)`` and switches
back), so any thread or forked process can read through the link.

Teardown on every exit path: ``close`` / ``__exit__``, ``atexit``, SIGTERM in the creating process;
the server process dies with its creator (``PR_SET_PDEATHSIG``), and :func:`cleanup_stale_servers`,
run by every new server, deletes the namespaces of dead creators.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import http.client
import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from sparsecomm.launch.netemu import parse_rate, unavailable_reason
from sparsecomm.launch.netns import NETNS_DIR, run_tool, setns, stale_namespaces

__all__ = ["FileServer", "FileClient", "cleanup_stale_servers", "unavailable_reason"]

log = logging.getLogger(__name__)

SERVER_ADDRESS = "10.214.0.1"
CLIENT_ADDRESS = "10.214.0.2"
PORT = 8000
MIN_BURST_BYTES = 64 * 1024
_NAME_RE = re.compile(r"^scfs(?P<pid>\d+)-(?P<counter>\d+)-(?P<role>srv|cli)$")
_counter = itertools.count()
_open_servers: set[FileServer] = set()
_lock = threading.Lock()
_PR_SET_PDEATHSIG = 1


def _kill_and_delete(namespace: str) -> None:
    """Kill what runs inside ``namespace`` and delete it (quietly when it is already gone)."""
    if not os.path.exists(os.path.join(NETNS_DIR, namespace)):
        return
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    try:
        run_tool("ip", "netns", "delete", namespace)
    except RuntimeError as exc:
        log.warning("could not delete network namespace %s: %s", namespace, exc)


def cleanup_stale_servers() -> list[str]:
    """Delete the namespaces of this module's naming scheme whose creating process is dead."""
    removed = stale_namespaces(_NAME_RE)
    for name in removed:
        _kill_and_delete(name)
    return removed


def _close_owned() -> None:
    with _lock:
        owned = [s for s in _open_servers if s.owner_pid == os.getpid()]
    for server in owned:
        server.close()


_previous_sigterm: object = None
_handlers_installed = False


def _on_sigterm(signum: int, frame: object) -> None:
    _close_owned()
    if callable(_previous_sigterm):
        _previous_sigterm(signum, frame)
    elif _previous_sigterm != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_handlers() -> None:
    global _previous_sigterm, _handlers_installed
    if _handlers_installed:
        return
    atexit.register(_close_owned)
    if threading.current_thread() is threading.main_thread():
        _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    _handlers_installed = True


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def connect_in(namespace: str, address: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``address:port`` opened from inside ``namespace`` by the calling thread,
    which then returns to its own namespace (the socket stays in ``namespace``)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(target)
        try:
            return socket.create_connection((address, port), timeout=timeout)
        finally:
            setns(home)
    finally:
        os.close(target)
        os.close(home)


class _NamespacedConnection(http.client.HTTPConnection):
    def __init__(self, namespace: str, timeout: float) -> None:
        super().__init__(SERVER_ADDRESS, PORT, timeout=timeout)
        self.namespace = namespace
        self.pid = os.getpid()  # a forked child opens its own connection

    def connect(self) -> None:
        self.sock = connect_in(self.namespace, self.host, self.port, self.timeout)  # type: ignore[arg-type]
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FileClient:
    """Reads files of a :class:`FileServer` over its link: one persistent HTTP/1.1 connection per
    thread. Picklable state is only the namespace name, so it works in forked workers too."""

    def __init__(self, namespace: str, timeout: float = 30.0) -> None:
        self.namespace = namespace
        self.timeout = timeout
        self._local = threading.local()
        self.bytes_read = 0

    def fetch(self, name: str) -> bytes:
        """The bytes of file ``name`` (a path relative to the served directory)."""
        for attempt in (0, 1):
            connection = getattr(self._local, "connection", None)
            if connection is None or connection.pid != os.getpid():
                connection = self._local.connection = _NamespacedConnection(self.namespace, self.timeout)
            try:
                connection.request("GET", "/" + name.lstrip("/"))
                response = connection.getresponse()
                body = response.read()
            except (http.client.HTTPException, ConnectionError):
                connection.close()
                self._local.connection = None
                if attempt:
                    raise
                continue
            if response.status != 200:
                raise FileNotFoundError(f"file server: GET /{name} answered {response.status} {response.reason}")
            self.bytes_read += len(body)
            return body
        raise AssertionError("unreachable")


class FileServer:
    """``python -m http.server`` serving ``root`` in its own namespace behind a ``rate``-limited link.

    Args:
        root: the directory served.
        rate: the link's rate both ways, a tc rate with its unit ("10mbit", "1gbit").
        latency: tbf's longest queueing delay (tc time in seconds here) before a packet is dropped.
    """

    def __init__(self, root: str, rate: str = "10mbit", *, latency_s: float = 0.2) -> None:
        if not os.path.isdir(root):
            raise ValueError(f"root={root!r} must be an existing directory")
        self.root = os.path.abspath(root)
        self.rate = rate
        self.rate_bits_per_second = parse_rate(rate)
        self.burst_bytes = int(max(self.rate_bits_per_second / 8 * 1e-3, MIN_BURST_BYTES))
        self.latency_s = latency_s
        self.owner_pid = os.getpid()
        base = f"scfs{self.owner_pid}-{next(_counter)}"
        self.server_namespace, self.client_namespace = f"{base}-srv", f"{base}-cli"
        self._process: subprocess.Popen | None = None
        self._open = False

    def __enter__(self) -> FileServer:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"FileServer needs network namespaces: {reason}")
        cleanup_stale_servers()
        _install_handlers()
        with _lock:
            _open_servers.add(self)
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _tbf(self, device: str) -> str:
        return (f"qdisc add dev {device} root tbf rate {self.rate_bits_per_second:.0f}bit "
                f"burst {self.burst_bytes} latency {self.latency_s * 1e6:.0f}us")

    def _build(self) -> None:
        srv, cli = self.server_namespace, self.client_namespace
        run_tool("ip", "netns", "add", srv)
        run_tool("ip", "netns", "add", cli)
        run_tool("ip", "-n", srv, "-batch", "-", stdin="\n".join([
            "link set lo up", f"link add fs-srv type veth peer name fs-cli netns {cli}",
            f"addr add {SERVER_ADDRESS}/30 dev fs-srv", "link set fs-srv addrgenmode none",
            "link set fs-srv up"]) + "\n")
        run_tool("ip", "-n", cli, "-batch", "-", stdin="\n".join([
            "link set lo up", f"addr add {CLIENT_ADDRESS}/30 dev fs-cli", "link set fs-cli addrgenmode none",
            "link set fs-cli up"]) + "\n")
        run_tool("tc", "-n", srv, *self._tbf("fs-srv").split())
        run_tool("tc", "-n", cli, *self._tbf("fs-cli").split())
        # HTTP/1.1 (Python >= 3.11): persistent connections, one per client thread
        protocol = ["--protocol", "HTTP/1.1"] if sys.version_info >= (3, 11) else []
        self._process = subprocess.Popen(
            ["ip", "netns", "exec", srv, sys.executable, "-m", "http.server", str(PORT), "--bind", SERVER_ADDRESS,
             "--directory", self.root, *protocol],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 20
        while True:
            try:
                connect_in(cli, SERVER_ADDRESS, PORT, timeout=1.0).close()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the file server in {srv} did not start "
                                       f"(exit code {self._process.poll()})") from None
                time.sleep(0.05)
        log.info("file server for %s at %s in %s, link %s", self.root, SERVER_ADDRESS, srv, self.rate)

    def client(self, timeout: float = 30.0) -> FileClient:
        """A reader of this server's files over the link."""
        if not self._open:
            raise RuntimeError("FileServer.client(): the server is not open (use it inside its `with` block)")
        return FileClient(self.client_namespace, timeout)

    def close(self) -> None:
        """Stop the server and delete both namespaces; idempotent, only in the creating process."""
        if not self._open or os.getpid() != self.owner_pid:
            return
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        for namespace in (self.client_namespace, self.server_namespace):
            _kill_and_delete(namespace)
        self._open = False
        with _lock:
            _open_servers.discard(self)

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileServer(root={self.root!r}, rate={self.rate!r}, {'open' if self._open else 'closed'})"
