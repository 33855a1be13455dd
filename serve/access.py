"""Who may do what on a Triton server: the key that Triton's control plane (model load and unload, repository
index, shared memory, logging, trace) answers to, where a client finds it, and the TLS a client speaks."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from torchship.errors import ConfigError, ServerError
from torchship.io import atomic_write_text

# The protocols a key guards, by Triton's names (the same for --grpc-restricted-protocol and
# --http-restricted-api). Inference, health, metadata, model config and statistics stay open: Triton's own
# clients read the model config, and the bench reads statistics; none of them changes the server.
RESTRICTED = ("model-repository", "shared-memory", "logging", "trace")
KEY_HEADER = "admin-key"  # the HTTP header; over gRPC Triton expects it as metadata with its own prefix
GRPC_KEY_HEADER = f"triton-grpc-protocol-{KEY_HEADER}"
KEY_ENV, KEY_FILE_ENV = "TORCHSHIP_TRITON_KEY", "TORCHSHIP_TRITON_KEY_FILE"
KEY_SERVER_ENV = "TORCHSHIP_TRITON_KEY_SERVER"  # HOST:PORT, the server the key of the two variables above is for
KEY_ENVS = (KEY_ENV, KEY_FILE_ENV, KEY_SERVER_ENV)  # kept out of the server's and its backends' environment
SERVER_LINE = "server:"  # a key file's second line, naming the server the key was made for


def restricted_flags(key: str) -> list[str]:
    """The tritonserver options that put ``RESTRICTED`` behind ``key`` on gRPC and HTTP."""
    spec = f"{','.join(RESTRICTED)}:{KEY_HEADER}={key}"
    return [f"--grpc-restricted-protocol={spec}", f"--http-restricted-api={spec}"]


@dataclass(frozen=True)
class Access:
    """What a client presents to one server: the control key (None: control calls go without one), and TLS
    files (PEM paths): ``tls_ca`` verifies the server, ``tls_cert``/``tls_key`` are the client's own for mutual
    TLS. ``key_source`` says where the key came from, for an error message (never the key itself); ``withheld``,
    why a key that was found was not presented here; ``insecure``: the user allows the key over plaintext to a
    server that is not on this machine (--insecure-key)."""

    key: Optional[str] = None
    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    key_source: str = ""
    withheld: str = ""
    insecure: bool = False

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def check_transport(self, url: str) -> None:
        """ConfigError, before any connection, where the key would cross the network in plaintext: a server that
        is not on this machine, without TLS, unless ``insecure``."""
        if self.key and not self.tls and not self.insecure and not is_loopback(url):
            raise ConfigError(
                f"{url} is not on this machine and is spoken to without TLS, so its control key ({self.key_source}) "
                "would cross the network in plaintext; give the server's CA with --tls-ca, go through a tunnel "
                "to a loopback address (ssh -L, kubectl port-forward), or say --insecure-key"
            )

    def grpc_headers(self) -> Optional[dict[str, str]]:
        """The metadata a control call carries (None without a key)."""
        return {GRPC_KEY_HEADER: self.key} if self.key else None

    def credentials(self):
        """grpc channel credentials for TLS, or None for a plaintext channel."""
        if not self.tls:
            return None
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca, "--tls-ca"),
            private_key=_read(self.tls_key, "--tls-key"),
            certificate_chain=_read(self.tls_cert, "--tls-cert"),
        )

    def __repr__(self) -> str:  # never print the key
        return (
            f"Access(key={'set' if self.key else None}, key_source={self.key_source!r}, tls_ca={self.tls_ca!r}, "
            f"tls_cert={self.tls_cert!r}, tls_key={self.tls_key!r})"
        )


def _read(path: Optional[str], flag: str) -> Optional[bytes]:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None


_given: dict[str, Access] = {}  # url -> what this process was told to present there (flags, a server it started)


def canonical(url: str) -> str:
    """``url`` (HOST:PORT) with this machine's names for itself as one spelling: localhost is 127.0.0.1."""
    host, _, port = url.rpartition(":")
    host = host.strip("[]")
    return f"{'127.0.0.1' if host.lower() == 'localhost' else host}:{port}"


def is_loopback(url: str) -> bool:
    """Whether the server at ``url`` is on this machine, reached over loopback."""
    host = canonical(url).rpartition(":")[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified  # 0.0.0.0 and :: reach this machine's own servers


def remember(url: str, access: Access) -> None:
    """Present ``access`` to the server at ``url`` from now on in this process (the CLI's flags, or a server
    this process started)."""
    _given[canonical(url)] = access


def forget(url: str) -> None:
    _given.pop(canonical(url), None)


def access_for(url: str) -> Access:
    """What a client of ``url`` presents: what this process was given for it, else a key from
    $TORCHSHIP_TRITON_KEY or the file $TORCHSHIP_TRITON_KEY_FILE names, else the key file that a torchship
    serve on this machine keeps for that address, else nothing. A key is presented only to the server it was
    made for: the one its file names (``server: HOST:PORT``), else the one $TORCHSHIP_TRITON_KEY_SERVER names,
    else, for a key that names none, a server on this machine."""
    if canonical(url) in _given:
        return _given[canonical(url)]
    if os.environ.get(KEY_ENV):
        found = Access(key=os.environ[KEY_ENV].strip(), key_source=f"${KEY_ENV}")
        return bound(found, url, os.environ.get(KEY_SERVER_ENV) or None)
    if os.environ.get(KEY_FILE_ENV):
        path = os.environ[KEY_FILE_ENV]
        key, server = read_key_file(path)
        return bound(Access(key=key, key_source=path), url, server or os.environ.get(KEY_SERVER_ENV) or None)
    path = key_path(url)
    if path.exists():
        key, server = read_key_file(path)
        return bound(Access(key=key, key_source=str(path)), url, server)
    return Access()


def bound(found: Access, url: str, server: Optional[str]) -> Access:
    """``found`` where ``url`` is the server its key was made for (``server``; None: any on this machine), else
    no key, saying why."""
    if (server is None and is_loopback(url)) or (server is not None and canonical(server) == canonical(url)):
        return found
    made_for = f"the server at {server}" if server else "servers on this machine"
    return Access(
        withheld=f"the key from {found.key_source} is for {made_for}, so it was not sent to {url} (name the server "
        f"with ${KEY_SERVER_ENV}, or give its key with --key-file FILE)"
    )


def with_flags(
    url: str,
    key_file: Optional[str] = None,
    tls_ca: Optional[str] = None,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    insecure_key: bool = False,
) -> Access:
    """The access a client command's flags ask for at ``url``, remembered for this process: --key-file over
    the defaults of access_for(), the TLS files and --insecure-key. ConfigError naming the flag when one is
    unusable, and before any connection where the key would go to another machine in plaintext."""
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("--tls-cert and --tls-key go together (a client certificate and its private key)")
    base = access_for(url)
    if key_file:
        key, server = read_key_file(key_file, "--key-file")
        if server and canonical(server) != canonical(url):
            raise ConfigError(f"--key-file {key_file}: the key is for the server at {server}, not {url}")
        base = Access(key=key, key_source=key_file)
    check_files({"--tls-ca": tls_ca, "--tls-cert": tls_cert, "--tls-key": tls_key})
    access = replace(base, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, insecure=bool(insecure_key))
    access.check_transport(url)
    remember(url, access)
    return access


def check_files(paths: dict[str, Optional[str]]) -> None:
    """ConfigError naming the flag of the first given path (flag -> path) that is not a file."""
    for flag, path in paths.items():
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")


def read_key(path: str | Path, flag: str = "the key file") -> str:
    """The key in ``path`` (its first line); ConfigError naming ``flag`` when it cannot be read or is empty."""
    return read_key_file(path, flag)[0]


def read_key_file(path: str | Path, flag: str = "the key file") -> tuple[str, Optional[str]]:
    """(the key in ``path``, its first line; the server it names on a ``server: HOST:PORT`` line, or None);
    ConfigError naming ``flag`` when it cannot be read or holds no key."""
    try:
        lines = [line.strip() for line in Path(path).read_text().strip().splitlines()]
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    if not lines or not lines[0]:
        raise ConfigError(f"{flag} {path}: it is empty")
    server = next((line[len(SERVER_LINE) :].strip() for line in lines[1:] if line.startswith(SERVER_LINE)), None)
    return lines[0], server or None


def key_dir() -> Path:
    """Where torchship serve keeps each server's key: a folder only this user can open."""
    base = os.environ.get("XDG_RUNTIME_DIR") or str(Path.home() / ".cache")
    return Path(base) / "torchship" / "keys"


def key_path(url: str) -> Path:
    """The key file of the server at ``url`` (HOST:PORT), one for both spellings of loopback."""
    return key_dir() / (canonical(url).replace(":", "_") + ".key")


def write_key(url: str, key: str) -> Path:
    """Write ``key`` for the server at ``url`` into a file only this user can read (written whole, then renamed
    into place), naming the server it is for; ServerError when the folder is not this user's alone."""
    d = key_dir()
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = d.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise ServerError(
            f"{d} holds the servers' control keys and must belong to this user alone (mode 700); "
            f"it is mode {stat.S_IMODE(info.st_mode):o}, owner uid {info.st_uid}: fix it, or set "
            "XDG_RUNTIME_DIR to a private folder"
        )
    prune_keys(d)
    return atomic_write_text(key_path(url), f"{key}\n{SERVER_LINE} {canonical(url)}\n", mode=0o600)


PRUNE_AFTER_S = 600.0  # a key file younger than this may be a server still starting, whose port is not open yet


def prune_keys(folder: Path) -> None:
    """Remove the key files of loopback servers that are gone (a server killed with its torchship process leaves
    its file behind): nothing listens on their port any more, and the file is older than PRUNE_AFTER_S (a server
    started a moment ago writes its key before it listens)."""
    for path in folder.glob("127.*.key"):
        host, _, port = path.stem.rpartition("_")
        try:
            if time.time() - path.stat().st_mtime < PRUNE_AFTER_S:
                continue
            with socket.create_connection((host, int(port)), timeout=0.5):
                continue
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
        except (OSError, ValueError):
            continue


def refusal_hint(url: str, access: Access) -> str:
    """What to do when the server at ``url`` refused a control call for want of its key."""
    if access.withheld:
        return f"the server at {url} answers model control only to its key; {access.withheld}"
    if access.key:
        return (
            f"the server at {url} refused the key from {access.key_source}: it is not this server's (a torchship "
            "serve makes a new key at each start); give the current one with --key-file FILE or "
            f"${KEY_ENV}"
        )
    return (
        f"the server at {url} answers model control only to its key; give it with --key-file FILE or ${KEY_ENV} "
        f"(torchship serve keeps it in {key_dir()}, one file per address)"
    )


ACCESS_FLAGS = ("key_file", "tls_ca", "tls_cert", "tls_key", "insecure_key")


def add_access_arguments(p) -> None:
    """--key-file and the client's TLS files, for a command that talks to the server at --url."""
    g = p.add_argument_group("access to the server at --url")
    g.add_argument(
        "--key-file",
        default=None,
        metavar="FILE",
        help=f"file holding the server's control key, for model load and unload (default: ${KEY_ENV}, "
        f"${KEY_FILE_ENV}, else the key torchship serve keeps for that address on this machine)",
    )
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="speak TLS, verifying the server's certificate against this CA (a server started with --tls-cert)",
    )
    g.add_argument(
        "--tls-cert",
        default=None,
        metavar="PEM",
        help="with --tls-key: this client's certificate, for a server that asks for one (--tls-client-ca)",
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="with --tls-cert: its private key")
    g.add_argument(
        "--insecure-key",
        action="store_true",
        help="send the control key to a server on another machine without TLS, in plaintext (refused otherwise)",
    )


def access_from_arguments(ns, url: Optional[str]) -> Optional[Access]:
    """What the parsed flags of add_access_arguments() ask to present at ``url``, remembered for this process;
    ConfigError where they are given without a --url to present them to."""
    given = [f"--{f.replace('_', '-')}" for f in ACCESS_FLAGS if getattr(ns, f, None)]
    if url is None:
        if given:
            raise ConfigError(
                f"{' and '.join(given)} go with --url (a running server); a server this command starts "
                "itself needs neither"
            )
        return None
    return with_flags(url, *(getattr(ns, f, None) for f in ACCESS_FLAGS))
