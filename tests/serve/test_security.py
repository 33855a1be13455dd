"""The control plane behind a key: the planted attacks refused without it, torchship's own control paths with
it, and the key out of sight (process list, log, files other users can read)."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli
from tests.helpers import plant_attacks
from torchship.errors import AccessError, ServerError
from torchship.serve.access import GRPC_KEY_HEADER, KEY_ENV, KEY_HEADER, Access, key_path
from torchship.serve.client import TritonClient
from torchship.serve.config import ServeConfig
from torchship.serve.embedded import TritonServer, describe

VICTIM = "tiny_cnn_onnx"


# Triton 2.51 itself refuses a new log file over the network, with the key or without it
NO_NETWORK_LOG_FILE = "log file location can not be updated through network protocol"


def attack(server, tmp_path, grpc_headers=None, http_headers=None) -> tuple[dict[str, str], bool, bool]:
    """(the server's answer to each attack, whether the planted code ran, whether a log file was written where the
    attacker said)."""
    marker, log_file = tmp_path / "marker", tmp_path / "redirected.log"
    accepted = plant_attacks(
        server.url, f"{server.cfg.host}:{server.http_port}", marker, log_file, VICTIM, grpc_headers, http_headers
    )
    return accepted, marker.exists(), log_file.exists()


def test_without_the_key_every_planted_control_call_is_refused(server, tmp_path):
    answers, ran, redirected = attack(server, tmp_path)
    assert len(answers) == 8 and set(answers.values()) == {"restricted"}, answers
    assert not ran and not redirected
    assert TritonClient(server.url).ready(VICTIM)  # the production model still serves
    wrong = {GRPC_KEY_HEADER: "not-the-key"}
    answers, ran, _ = attack(server, tmp_path, wrong, {KEY_HEADER: "not-the-key"})
    assert set(answers.values()) == {"restricted"} and not ran, answers


@pytest.mark.slow
def test_with_the_key_the_same_calls_are_accepted(repo, tmp_path):
    """The key opens what it guards: the planted code runs (so the marker check above can see it) and the
    victim is unloaded, then loaded again. On a server of its own: Triton 2.51 can count the model loaded with
    code as live after its unload, and then holds the shutdown until its exit timeout."""
    with TritonServer(ServeConfig(repo=str(repo), models=(VICTIM,), heal=False)).start() as server:
        answers, ran, redirected = attack(server, tmp_path, {GRPC_KEY_HEADER: server.key}, {KEY_HEADER: server.key})
        assert TritonClient(server.url).ready(VICTIM)
    assert ran and not redirected, answers
    assert answers == {
        **{k: "accepted" for k in answers},
        **{f"{p} log redirect": NO_NETWORK_LOG_FILE for p in ("grpc", "http")},
    }, answers


@pytest.mark.parametrize("fault", ["no restriction flags", "the helper not preloaded"])
def test_a_server_that_answers_control_without_the_key_does_not_start(repo, fault, monkeypatch):
    """Fails closed: once live, each start makes one control call without the key, and a server that answers it
    (started without the restriction, or with the helper that hands it over skipped) is stopped, in one line."""
    import torchship.serve.embedded.server as embedded

    if fault == "no restriction flags":
        monkeypatch.setattr(embedded, "restricted_flags", lambda key: [])
    else:
        real = embedded.hide

        def skipped(args, folder, env, exposed_ok=False):
            out = real(args, folder, env, exposed_ok)
            env.pop("LD_PRELOAD", None)  # as a loader that ignores the preload would leave it
            return out

        monkeypatch.setattr(embedded, "hide", skipped)
    server = TritonServer(ServeConfig(repo=str(repo), models=(VICTIM,), heal=False))
    with pytest.raises(ServerError, match="answered a control call without its key") as e:
        server.start()
    assert len(str(e.value).splitlines()) == 1 and not server.running


def test_the_helper_hands_over_every_argument_and_keeps_the_users_preload(tmp_path):
    """hidden_args.c on its own, in a program named tritonserver: all of 70 hidden arguments arrive after the
    visible ones, the file is removed, and the children see the user's own LD_PRELOAD and none of torchship's
    variables; an unreadable file stops the program before main, saying why."""
    from torchship.serve.embedded import hidden

    lib, why = hidden.shim(tmp_path)
    if lib is None:
        pytest.skip(why)
    prog = tmp_path / "tritonserver"
    prog.symlink_to(os.path.realpath(sys.executable))
    code = (
        "import os, sys, json; "
        "print(json.dumps([sys.argv[1:], {k: v for k, v in os.environ.items() if 'PRELOAD' in k or 'TORCHSHIP' in k}]))"
    )
    args = [f"--hidden-{i}=x" for i in range(70)]
    env = {"PATH": os.environ["PATH"], "LD_PRELOAD": "libm.so.6"}
    shown, path = hidden.hide(args, tmp_path, env)
    r = subprocess.run([str(prog), "-c", code, "--shown"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    argv, seen = json.loads(r.stdout)
    assert shown == [] and argv == ["--shown", *args] and not path.exists()
    assert seen == {"LD_PRELOAD": "libm.so.6"}, seen
    env[hidden.ARGS_ENV] = str(tmp_path / "absent")
    r = subprocess.run([str(prog), "-c", "print('ran')"], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "ran" not in r.stdout and "not starting without them" in r.stderr, r.stderr


def test_the_key_stays_out_of_sight(server):
    pids = [server.proc.pid] + [
        int(p) for p in (open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split())
    ]
    for pid in pids:  # what every user of the machine can read
        assert server.key.encode() not in open(f"/proc/{pid}/cmdline", "rb").read(), pid
    info = os.stat(server.key_file)
    assert stat.S_IMODE(info.st_mode) == 0o600 and stat.S_IMODE(os.stat(server.key_file.parent).st_mode) == 0o700
    assert server.key_file == key_path(server.url) == key_path(server.url.replace("127.0.0.1", "localhost"))
    assert server.key_file.read_text().splitlines() == [server.key, f"server: {server.url}"]
    assert server._hidden_args is not None and not server._hidden_args.exists()  # read by the server, then removed
    admin = TritonClient(server.url)
    admin.client.update_log_settings({"log_verbose_level": 1}, headers=admin.control_headers)
    try:  # a control call while the log is verbose
        admin.client.get_model_repository_index(headers=admin.control_headers)
    finally:
        admin.client.update_log_settings({"log_verbose_level": 0}, headers=admin.control_headers)
    assert server.key not in server.log_path.read_text(errors="replace")
    assert server.key not in json.dumps(describe(server)) and server.key not in repr(server.access)


def test_a_client_finds_the_key_of_a_server_on_this_machine_or_is_told_what_to_give(server, tmp_path):
    code = (
        "import sys; from torchship.serve.client import TritonClient; c = TritonClient(sys.argv[1]); "
        "c.client.get_model_repository_index(headers=c.control_headers); print(c.access.key_source)"
    )
    env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, "TORCHSHIP_TRITON_KEY_FILE")}
    r = subprocess.run([sys.executable, "-c", code, server.url], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0 and r.stdout.strip() == str(server.key_file), r.stderr[-2000:]
    with pytest.raises(AccessError, match="--key-file FILE or \\$TORCHSHIP_TRITON_KEY"):
        TritonClient(server.url, access=Access()).unload(VICTIM)
    wrong = tmp_path / "wrong.key"
    wrong.write_text("not-the-key\n")
    with pytest.raises(AccessError, match="refused the key from .*wrong.key"):
        TritonClient(server.url, access=Access(key="not-the-key", key_source=str(wrong))).unload(VICTIM)
    assert TritonClient(server.url).ready(VICTIM)


def test_a_key_file_flag_is_read_at_the_boundary(server, tmp_path, capsys):
    from torchship.serve.access import remember, with_flags

    assert run_cli("rollback", tmp_path, "--url", server.url, "--key-file", tmp_path / "absent.key") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--key-file" in err and "cannot read it" in err, err
    assert run_cli("bench", tmp_path, "--key-file", tmp_path / "absent.key") == 2
    assert "--key-file go with --url" in capsys.readouterr().err
    wrong = tmp_path / "wrong.key"
    wrong.write_text("not-the-key\n")
    try:
        assert with_flags(server.url, key_file=str(wrong)).key == "not-the-key"
        with pytest.raises(AccessError, match="wrong.key"):
            TritonClient(server.url).unload(VICTIM)
    finally:
        remember(server.url, server.access)
    assert TritonClient(server.url).ready(VICTIM)


@pytest.fixture(scope="module")
def tls_server(repo, tmp_path_factory):
    """The tiny CNN served over mutual TLS: a CA made here signed the server's and the client's certificates."""
    from tests.helpers import make_certs

    certs = make_certs(tmp_path_factory.mktemp("certs"))
    cfg = ServeConfig(
        repo=str(repo),
        models=(VICTIM,),
        heal=False,
        tls_cert=certs["server_cert"],
        tls_key=certs["server_key"],
        tls_ca=certs["ca"],
        tls_client_ca=certs["ca"],
        tls_own_cert=certs["client_cert"],
        tls_own_key=certs["client_key"],
    )
    with TritonServer(cfg).start() as s:
        yield s, certs


def test_infer_check_passes_over_mutual_tls(tls_server, exported, capsys):
    s, certs = tls_server
    assert describe(s)["mutual_tls"] and "--grpc-use-ssl-mutual=true" in s.command()
    tls = ["--tls-ca", certs["ca"], "--tls-cert", certs["client_cert"], "--tls-key", certs["client_key"]]
    assert run_cli("infer", "--url", s.url, *tls, "--check", exported, "--model", VICTIM) == 0
    assert "served parity: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("client", ["plaintext", "no client certificate", "wrong CA"])
def test_a_tls_server_refuses_a_client_without_the_right_certificates(tls_server, client, tmp_path):
    s, certs = tls_server
    access = {
        "plaintext": Access(),
        "no client certificate": Access(tls_ca=certs["ca"]),
        "wrong CA": Access(tls_ca=certs["client_cert"], tls_cert=certs["client_cert"], tls_key=certs["client_key"]),
    }
    with pytest.raises(AccessError, match="TLS"):
        TritonClient(s.url, access=access[client]).wait_ready(10)


def test_over_tls_control_still_needs_the_key(tls_server):
    s, certs = tls_server
    tls = Access(tls_ca=certs["ca"], tls_cert=certs["client_cert"], tls_key=certs["client_key"])
    with pytest.raises(AccessError, match="answers model control only to its key"):
        TritonClient(s.url, access=tls).unload(VICTIM)
    assert TritonClient(s.url, access=tls).ready(VICTIM)


def test_tls_options_are_checked_at_the_boundary(tmp_path):
    from torchship.errors import ConfigError

    pem = tmp_path / "x.pem"
    pem.write_text("x")
    for kwargs, says in (
        ({"tls_cert": str(pem)}, "--tls-cert and --tls-key go together"),
        ({"tls_client_ca": str(pem)}, "go with --tls-cert"),
        ({"tls_cert": str(pem), "tls_key": str(pem), "tls_client_ca": str(pem)}, "--tls-own-cert"),
        ({"tls_cert": str(tmp_path / "absent.pem"), "tls_key": str(pem)}, "no such file"),
    ):
        with pytest.raises(ConfigError, match=says):
            ServeConfig(**kwargs)
    assert ServeConfig(tls_cert=str(pem), tls_key=str(pem)).tls_flags()[0] == "--grpc-use-ssl=true"
    assert ServeConfig().tls_flags() == []


def test_without_a_working_compiler_the_server_refuses_unless_told_the_key_may_show(tmp_path, monkeypatch, capsys):
    """The branches of hide(): the helper built by cc takes the arguments off the command line; where no
    compiler is found, or the one found fails, the start is refused, naming the fix; with --key-on-command-line
    they stay on it, and one line says what that exposes."""
    from torchship.errors import ServerError
    from torchship.serve.embedded import hidden

    env: dict[str, str] = {}
    shown, path = hidden.hide(["--secret=1"], tmp_path, env)
    assert shown == [] and path.read_text() == "--secret=1\n" and oct(path.stat().st_mode)[-3:] == "600"
    assert env[hidden.ARGS_ENV] == str(path) and env["LD_PRELOAD"].endswith(".so")
    monkeypatch.setenv("CC", "false")  # a compiler that exists but cannot build (gcc without libc headers, say)
    (tmp_path / "bad-cc").mkdir()
    env = {}
    with pytest.raises(ServerError, match="failed to build .* the helper .* --key-on-command-line") as e:
        hidden.hide(["--secret=1"], tmp_path / "bad-cc", env)
    assert "no C compiler" not in str(e.value) and "apt-get install gcc" in str(e.value) and env == {}
    shown, path = hidden.hide(["--secret=1"], tmp_path / "bad-cc", env, exposed_ok=True)
    assert shown == ["--secret=1"] and path is None and env == {}
    assert "other users of this machine can read it" in capsys.readouterr().err
    monkeypatch.setattr(hidden.shutil, "which", lambda name: None)
    (tmp_path / "no-cc").mkdir()
    with pytest.raises(ServerError, match="no C compiler"):
        hidden.hide(["--secret=1"], tmp_path / "no-cc", env)
    shown, path = hidden.hide(["--secret=1"], tmp_path / "no-cc", env, exposed_ok=True)
    assert shown == ["--secret=1"] and path is None and env == {}


def test_torchship_serve_without_a_compiler_exits_with_one_line_and_starts_no_server(repo, monkeypatch, capsys):
    """Fail closed at the command: no tritonserver is started with the key on its command line unless asked."""
    from torchship.serve.embedded import hidden

    monkeypatch.setattr(hidden, "shim", lambda folder: (None, "no C compiler (cc) is here to build"))
    assert run_cli("serve", repo) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--key-on-command-line" in err[0], err


def test_a_backend_folder_others_can_open_is_refused(tmp_path, monkeypatch):
    """The server runs the code in that folder (and preloads the helper from it): one that others can only read
    is closed to them, one that another user made or can write to is refused, naming it."""
    from torchship.serve.embedded import wheel

    monkeypatch.setattr(wheel.tempfile, "gettempdir", lambda: str(tmp_path))
    d = wheel.private_dir()
    assert oct(d.stat().st_mode)[-3:] == "700"
    d.chmod(0o755)  # ours, readable by others: closed
    assert wheel.private_dir() == d and oct(d.stat().st_mode)[-3:] == "700"
    d.chmod(0o777)  # others could have put code in it: refused
    with pytest.raises(ServerError, match="not this user's alone"):
        wheel.private_dir()


def test_a_key_goes_only_to_the_server_it_was_made_for_and_never_in_plaintext_off_this_machine(
    tmp_path, monkeypatch, capsys
):
    """A key file names its server; both spellings of loopback find one file; a key from the environment goes to a
    server on this machine or to the one $TORCHSHIP_TRITON_KEY_SERVER names; a key for a server on another
    machine without TLS is refused before any connection (192.0.2.1 is a documentation address: nothing is
    sent), unless --insecure-key."""
    import torchship.serve.access as access
    from torchship.errors import ConfigError

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for name in access.KEY_ENVS:
        monkeypatch.delenv(name, raising=False)
    access.write_key("localhost:5001", "local")
    assert access.access_for("127.0.0.1:5001").key == "local" and access.access_for("127.0.0.1:5002").key is None
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert access.access_for("127.0.0.1:5003").key == "from-env"
    far = "192.0.2.1:8001"
    withheld = access.access_for(far)
    assert withheld.key is None and "not sent to 192.0.2.1:8001" in access.refusal_hint(far, withheld)
    monkeypatch.setenv(access.KEY_SERVER_ENV, far)
    assert access.access_for(far).key == "from-env" and access.access_for("127.0.0.1:5003").key is None
    with pytest.raises(ConfigError, match="plaintext.*--insecure-key"):
        TritonClient(far)
    TritonClient(far, access=access.Access(key="k", insecure=True)).close()  # allowed when asked; never called
    other = tmp_path / "other.key"
    other.write_text("k\nserver: 127.0.0.1:9\n")
    with pytest.raises(ConfigError, match="is for the server at 127.0.0.1:9, not 127.0.0.1:5003"):
        access.with_flags("127.0.0.1:5003", key_file=str(other))
    given = tmp_path / "given.key"
    given.write_text("k\n")
    capsys.readouterr()
    assert run_cli("rollback", tmp_path, "--url", "192.0.2.1:8002", "--key-file", given) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--insecure-key" in err, err


def test_the_key_files_of_servers_that_are_gone_are_removed(tmp_path, monkeypatch):
    import torchship.serve.access as access
    from torchship.serve.embedded.process import free_ports

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    gone = access.write_key(f"127.0.0.1:{free_ports()[0]}", "old")
    starting = access.write_key(f"127.0.0.1:{free_ports()[0]}", "starting")
    old = time.time() - access.PRUNE_AFTER_S - 1
    os.utime(gone, (old, old))
    access.write_key("127.0.0.1:1", "new")  # a start prunes what nothing listens for any more
    assert not gone.exists() and access.read_key(access.key_path("127.0.0.1:1")) == "new"
    # a file written a moment ago may be a server still starting, not listening yet: kept
    assert access.read_key(starting) == "starting"


@pytest.mark.slow
def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, by the parent each names in /proc."""
    parent = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat_file.parent.name)] = int(stat_file.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError):
            continue
    below, todo = [], [pid]
    while todo:
        up = todo.pop()
        kids = [p for p, pp in parent.items() if pp == up]
        below += kids
        todo += kids
    return below


def environ(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/environ", "rb").read()
    except FileNotFoundError:
        return b""


def test_torchship_serve_refuses_the_attack_and_removes_its_key_when_it_stops(repo, tmp_path):
    """torchship serve as a user starts it, in a process of its own: the planted attacks are refused, the key file
    it prints is its user's alone, a key in the user's environment reaches neither tritonserver nor the backends,
    and the key file is gone once the server stops."""
    from torchship.serve.embedded.process import free_ports

    grpc, http = free_ports(n=2)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torchship.pipeline.cli",
            "serve",
            str(repo),
            "--models",
            VICTIM,
            "--grpc-port",
            str(grpc),
            "--http-port",
            str(http),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, KEY_ENV: "a-key-of-the-users"},
    )
    try:
        lines, deadline = [], time.monotonic() + 120
        while not any(line.startswith("control key:") for line in lines) and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        key_file = Path(next(line for line in lines if line.startswith("control key:")).split()[2])
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        marker = tmp_path / "marker"
        answers = plant_attacks(f"127.0.0.1:{grpc}", f"127.0.0.1:{http}", marker, tmp_path / "log", VICTIM)
        assert set(answers.values()) == {"restricted"} and not marker.exists(), answers
        key = key_file.read_text().splitlines()[0]
        assert key.encode() not in open(f"/proc/{proc.pid}/cmdline", "rb").read()
        below = descendants(proc.pid)  # tritonserver and its backend stubs, which run model code
        assert len(below) >= 2 and all(b"TORCHSHIP_TRITON_KEY" not in environ(pid) for pid in below), below
        assert all(key not in line for line in lines)
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0 and "server stopped (exit code 0)" in out, out
    assert not key_file.exists()
