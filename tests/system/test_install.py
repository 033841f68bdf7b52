"""Installation: ``systemd/install.sh`` (owners, modes, credentials, TLS) and ``make install``
with ``SYSTEM_TORCH=1`` (a Jetson's system-wide torch is reused, never replaced).

The install script runs into a temporary ``--root``; nothing touches the real /etc. As root (CI),
an unprivileged uid (65534, no user is created) then reads what the service would read, with the
secrets handed over the way systemd's ``LoadCredential=`` does; the units go through
``systemd-analyze verify`` when that tool exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud_verifier.daemon import cli as verifier_cli
from cloud_verifier.daemon.auth import Authenticator
from cloud_verifier.daemon.tls import server_context
from edge_agent.daemon import cli as edge_cli
from edge_agent.runtime.settings import read_secret_file
from tests.tls import self_signed

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "systemd" / "install.sh"
NOBODY = 65534  # an unprivileged uid standing in for the DynamicUser; no user is created
IS_ROOT = os.geteuid() == 0
CRED = "${CREDENTIALS_DIRECTORY}"


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def root() -> Iterator[Path]:
    """A temporary root that other uids can traverse (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="wanspec-install-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and its key (PEM)."""
    return self_signed(tmp_path_factory.mktemp("tls"))


def run_install(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert proc.returncode == 0, proc.stderr + proc.stdout
    return proc


def service_section(unit: Path) -> list[tuple[str, str]]:
    """(key, value) of the [Service] section, in order."""
    out: list[tuple[str, str]] = []
    section = ""
    for line in unit.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.append((key, value))
    return out


def credentials(unit: Path) -> dict[str, str]:
    """LoadCredential= ID → absolute source path."""
    creds: dict[str, str] = {}
    for key, value in service_section(unit):
        if key == "LoadCredential":
            ident, _, path = value.partition(":")
            assert path.startswith("/"), value
            creds[ident] = path
    return creds


def exec_start(unit: Path) -> list[str]:
    values = [v for k, v in service_section(unit) if k == "ExecStart"]
    assert len(values) == 1, values
    return shlex.split(values[0])


def load_credentials(root: Path, unit: Path) -> Path:
    """What systemd does for LoadCredential=: read each source as root, hand the service a
    copy in a directory only its uid can read (0500 directory, 0400 files)."""
    d = root / "run" / "credentials" / unit.name
    d.mkdir(parents=True)
    for ident, src in credentials(unit).items():
        (d / ident).write_bytes((root / src.lstrip("/")).read_bytes())
        (d / ident).chmod(0o400)
        if IS_ROOT:
            os.chown(d / ident, NOBODY, NOBODY)
    d.chmod(0o500)
    if IS_ROOT:
        os.chown(d, NOBODY, NOBODY)
    return d


def service_argv(root: Path, unit: Path, creds: Path) -> list[str]:
    """ExecStart's arguments after the program, as the service would see them, with /etc paths
    moved below ``root``."""
    argv = []
    for arg in exec_start(unit)[1:]:
        arg = arg.replace(CRED, str(creds))
        if arg.startswith("/etc/"):
            arg = str(root / arg.lstrip("/"))
        argv.append(arg)
    return argv


def owner_mode(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def expected_owner() -> tuple[int, int]:
    # root in production and in CI; the invoking user when a developer runs the tests
    return (0, 0) if IS_ROOT else (os.geteuid(), os.getegid())


def check_layout(root: Path, secrets: set[str], public: set[str], unit_name: str) -> None:
    """Settings world-readable, secrets root-only, nothing else in /etc/wanspec."""
    uid, gid = expected_owner()
    etc = root / "etc" / "wanspec"
    private = etc / "private"
    assert owner_mode(etc) == (uid, gid, 0o755)
    assert owner_mode(private) == (uid, gid, 0o700)
    assert {p.name for p in private.iterdir()} == secrets
    for name in secrets:
        assert owner_mode(private / name) == (uid, gid, 0o600), name
    assert {p.name for p in etc.iterdir()} == public | {"private"}
    for name in public:
        assert owner_mode(etc / name) == (uid, gid, 0o644), name
    unit = root / "etc" / "systemd" / "system" / unit_name
    assert owner_mode(unit) == (uid, gid, 0o644)
    # every secret reaches the service through LoadCredential=, from where the script put it
    assert credentials(unit) == {name: f"/etc/wanspec/private/{name}" for name in secrets}


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
    )


def check_unprivileged_access(root: Path, readable: list[Path], secrets: list[Path]) -> None:
    """As uid 65534: every path the service reads opens; no secret at its source does."""
    if not IS_ROOT or not all(os.stat(d).st_mode & stat.S_IXOTH for d in root.parents):
        return  # owners and modes above still say it; switching uid needs root and a path to root
    for p in readable:
        r = as_nobody("cat", str(p))
        assert r.returncode == 0, f"{p}: {r.stderr}"
    for p in secrets:
        r = as_nobody("cat", str(p))
        assert r.returncode != 0 and "Permission denied" in r.stderr, p
    r = as_nobody("ls", str(root / "etc" / "wanspec" / "private"))
    assert r.returncode != 0 and "Permission denied" in r.stderr


def verify_units(root: Path, *units: Path) -> None:
    """``systemd-analyze verify`` with the ExecStart programs present (stubs)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        return
    for unit in units:
        proc = subprocess.run(
            [tool, "verify", str(unit)], capture_output=True, text=True, timeout=60
        )
        complaints = [line for line in proc.stderr.splitlines() if unit.name in line]
        assert proc.returncode == 0 and not complaints, proc.stderr


@pytest.fixture
def prefix(root: Path) -> Path:
    """A stand-in for the checkout at /opt/wanspec: executable stubs, so that
    systemd-analyze verify finds the ExecStart programs."""
    p = root / "opt" / "wanspec"
    (p / ".venv" / "bin").mkdir(parents=True)
    for name in ("cloud-verifier", "edge-agent"):
        stub = p / ".venv" / "bin" / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return p


# ----------------------------------------------------------------------------- cloud


def test_install_cloud_tls_secrets_only_via_credentials(
    root: Path, prefix: Path, tls_pair: tuple[Path, Path]
) -> None:
    cert, key = tls_pair
    proc = run_install(
        root, "cloud", "--prefix", str(prefix), "--tls-cert", str(cert), "--tls-key", str(key)
    )
    assert "generated a bearer token" in proc.stdout
    etc = root / "etc" / "wanspec"
    unit = root / "etc" / "systemd" / "system" / "cloud-verifier.service"
    check_layout(root, {"tokens", "tls.crt", "tls.key"}, {"verifier.toml"}, unit.name)
    assert (etc / "private" / "tls.key").read_bytes() == key.read_bytes()
    assert exec_start(unit)[0] == f"{prefix}/.venv/bin/cloud-verifier"

    # The service's view: its argv resolved by the verifier's own settings loader.
    creds = load_credentials(root, unit)
    args = verifier_cli.build_parser().parse_args(service_argv(root, unit, creds))
    settings = verifier_cli.load_cli_settings(args, {})
    assert settings.host == "0.0.0.0"  # listening on the network: then TLS, always
    assert settings.tls_cert == creds / "tls.crt" and settings.tls_key == creds / "tls.key"
    assert settings.token_file == creds / "tokens"
    assert Authenticator(token_file=settings.token_file).enabled
    server_context(settings.tls_cert, settings.tls_key)  # the pair loads

    check_unprivileged_access(
        root,
        readable=[etc / "verifier.toml", creds / "tokens", creds / "tls.crt", creds / "tls.key"],
        secrets=[etc / "private" / n for n in ("tokens", "tls.crt", "tls.key")],
    )
    verify_units(root, unit)


def test_install_cloud_behind_a_balancer_on_another_host_listens_on_its_address(
    root: Path, prefix: Path
) -> None:
    """A replica behind HAProxy on another host (systemd/haproxy-wanspec.cfg): --listen puts
    its private address on ExecStart, where the file cannot undo it (host in verifier.toml was
    ignored: the unit said 127.0.0.1); a bad address or --listen without --behind-proxy is
    refused before anything is written."""
    tokens = root / "given-tokens"
    tokens.write_text("replica-token\n")
    run_install(
        root, "cloud", "--behind-proxy", "--listen", "10.0.0.11", "--prefix", str(prefix),
        "--token", str(tokens),
    )  # fmt: skip
    unit = root / "etc" / "systemd" / "system" / "cloud-verifier.service"
    creds = load_credentials(root, unit)
    args = verifier_cli.build_parser().parse_args(service_argv(root, unit, creds))
    settings = verifier_cli.load_cli_settings(args, {})
    assert settings.host == "10.0.0.11" and settings.tls_cert is None
    verify_units(root, unit)
    for argv, why in (
        (["--behind-proxy", "--listen", "10.0.0.11; rm -rf /"], "not an address"),
        (["--listen", "10.0.0.11"], "--listen goes with --behind-proxy"),
    ):
        proc = run_install(root / "other", "cloud", *argv, "--prefix", str(prefix), check=False)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr
        assert not (root / "other").exists()


def test_install_cloud_behind_proxy_listens_on_loopback_only(root: Path, prefix: Path) -> None:
    tokens = root / "given-tokens"
    tokens.write_text("# rotation: both are accepted\nold-token\nnew-token\n")
    run_install(root, "cloud", "--behind-proxy", "--prefix", str(prefix), "--token", str(tokens))
    unit = root / "etc" / "systemd" / "system" / "cloud-verifier.service"
    check_layout(root, {"tokens"}, {"verifier.toml"}, unit.name)
    creds = load_credentials(root, unit)
    args = verifier_cli.build_parser().parse_args(service_argv(root, unit, creds))
    settings = verifier_cli.load_cli_settings(args, {"WANSPEC_HOST": "0.0.0.0"})
    # the flag beats the environment and the file: cleartext never leaves the host
    assert settings.host == "127.0.0.1"
    assert settings.tls_cert is None and settings.tls_key is None
    auth = Authenticator(token_file=settings.token_file)
    assert auth.check("Bearer new-token") and auth.check("Bearer old-token")
    check_unprivileged_access(
        root,
        readable=[root / "etc" / "wanspec" / "verifier.toml", creds / "tokens"],
        secrets=[root / "etc" / "wanspec" / "private" / "tokens"],
    )
    verify_units(root, unit)


def test_install_cloud_refuses_cleartext_on_the_network(
    root: Path, tls_pair: tuple[Path, Path]
) -> None:
    proc = run_install(root, "cloud", check=False)
    assert proc.returncode == 2 and "--tls-cert and --tls-key (or --behind-proxy)" in proc.stderr
    assert not (root / "etc" / "systemd" / "system" / "cloud-verifier.service").exists()
    proc = run_install(root, "cloud", "--tls-cert", str(tls_pair[0]), check=False)
    assert proc.returncode == 2 and "go together" in proc.stderr


def test_install_cloud_repairs_the_old_root_only_layout(
    root: Path, tls_pair: tuple[Path, Path]
) -> None:
    # What the README used to do: /etc/wanspec 0750, the tokens 0600 in it, settings 0644.
    etc = root / "etc" / "wanspec"
    etc.mkdir(parents=True)
    etc.chmod(0o750)
    (etc / "tokens").write_text("kept-token\n")
    (etc / "tokens").chmod(0o600)
    (etc / "verifier.toml").write_text('[verifier]\nmodel = "null:64"\nhost = "0.0.0.0"\n')
    (etc / "verifier.toml").chmod(0o600)
    if IS_ROOT:
        r = as_nobody("cat", str(etc / "verifier.toml"))
        assert "Permission denied" in r.stderr  # the failure the service used to hit
    cert, key = tls_pair
    proc = run_install(
        root,
        "cloud",
        "--token",
        str(etc / "tokens"),
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
    )
    assert "keeping" in proc.stdout and "tokens is no longer used" in proc.stdout
    assert 'model = "null:64"' in (etc / "verifier.toml").read_text()  # settings kept
    assert stat.S_IMODE((etc / "verifier.toml").stat().st_mode) & 0o004
    assert stat.S_IMODE(etc.stat().st_mode) == 0o755
    assert (etc / "private" / "tokens").read_text() == "kept-token\n"
    check_unprivileged_access(root, readable=[etc / "verifier.toml"], secrets=[etc / "tokens"])


# ----------------------------------------------------------------------------- edge


def test_install_edge_token_ca_and_api_key(
    root: Path, prefix: Path, tls_pair: tuple[Path, Path]
) -> None:
    token = root / "given-token"
    token.write_text("edge-secret\n")
    apikey = root / "given-apikey"
    apikey.write_text("api-secret\n")
    url = "wss://verifier.example:8765/v1/session"
    run_install(
        root,
        "edge",
        "--prefix",
        str(prefix),
        "--token",
        str(token),
        "--verifier",
        url,
        "--ca",
        str(tls_pair[0]),
        "--api-key",
        str(apikey),
    )
    etc = root / "etc" / "wanspec"
    unit = root / "etc" / "systemd" / "system" / "edge-agent.service"
    check_layout(root, {"edge.token", "edge.apikey"}, {"edge.toml", "ca.pem"}, unit.name)
    verify_units(root, unit)

    creds = load_credentials(root, unit)
    args = edge_cli.build_parser().parse_args(service_argv(root, unit, creds))
    settings = edge_cli.load_cli_settings(args, {})
    assert settings.verifier == url
    assert settings.ca_file == Path("/etc/wanspec/ca.pem")  # public, read in place
    assert settings.token_file == creds / "edge.token"
    assert settings.api_key_file == creds / "edge.apikey"
    assert read_secret_file(settings.token_file, "token_file") == "edge-secret"
    assert read_secret_file(settings.api_key_file, "api_key_file") == "api-secret"
    check_unprivileged_access(
        root,
        readable=[etc / "edge.toml", etc / "ca.pem", creds / "edge.token", creds / "edge.apikey"],
        secrets=[etc / "private" / "edge.token", etc / "private" / "edge.apikey"],
    )

    # Without an API key: the plain unit, as shipped (but for the prefix).
    (etc / "private" / "edge.apikey").unlink()
    run_install(root, "edge", "--prefix", str(prefix))  # edge.toml and the token are kept
    shipped = (REPO / "systemd" / "edge-agent.service").read_text()
    assert unit.read_text() == shipped.replace("/opt/wanspec", str(prefix))
    verify_units(root, unit)


def test_install_edge_refuses_a_cleartext_verifier(root: Path) -> None:
    token = root / "t"
    token.write_text("x\n")
    bad = run_install(
        root,
        "edge",
        "--token",
        str(token),
        "--verifier",
        "ws://203.0.113.7:8765/v1/session",
        check=False,
    )
    assert bad.returncode == 2 and "in clear" in bad.stderr
    assert not (root / "etc" / "wanspec" / "edge.toml").exists()
    run_install(root, "edge", "--token", str(token), "--verifier", "ws://127.0.0.1:8765/v1/session")


# ----------------------------------------------------------------------------- shipped files


def test_shipped_units_take_secrets_from_credentials() -> None:
    for name, secrets in (
        ("cloud-verifier.service", {"tokens", "tls.crt", "tls.key"}),
        ("edge-agent.service", {"edge.token"}),
    ):
        unit = REPO / "systemd" / name
        assert set(credentials(unit)) == secrets
        argv = exec_start(unit)
        for ident in secrets:
            assert f"{CRED}/{ident}" in argv, (name, ident)
        assert not any(a.startswith("/etc/wanspec/private") for a in argv)
        keys = {k for k, _ in service_section(unit)}
        assert "DynamicUser" in keys


def test_tp_drop_in_lets_rank_0_notify_and_sets_the_ranks() -> None:
    text = (REPO / "systemd" / "cloud-verifier-tp.conf").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "[Service]"
    assert "NotifyAccess=all" in lines
    assert any(re.fullmatch(r"Environment=WANSPEC_TP=\d+", ln) for ln in lines)


def test_documented_installs_without_cleartext_or_unreadable_secrets() -> None:
    """The install steps in README.md and the documentation site (docs/)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for page in pages:
        text = page.read_text()
        assert 'host = \\"0.0.0.0\\"' not in text, page  # the old printf into verifier.toml
        assert "/etc/wanspec/tokens" not in text, page
        # secrets the installer moved to /etc/wanspec/private (credentials): not as settings
        for old in ("/etc/wanspec/edge.token", "/etc/wanspec/edge.apikey"):
            assert old not in text, page
        assert not re.search(r"install -m 600 \S+ /etc/wanspec/", text), page
    cloud = (REPO / "docs" / "cloud" / "deploy.md").read_text()
    edge = (REPO / "docs" / "edge" / "jetson.md").read_text()
    assert "systemd/install.sh cloud" in cloud and "systemd/install.sh edge" in edge
    assert "make install SYSTEM_TORCH=1" in edge


# ----------------------------------------------------------------------------- make install


def _make() -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    return make


def test_make_install_dry_run_system_torch(tmp_path: Path) -> None:
    """``make -n``: the recipe's commands, not their effect (see the next test for that)."""
    make = _make()
    venv = tmp_path / "v"

    def recipe(*extra: str) -> list[str]:
        out = subprocess.run(
            # --no-print-directory: under `make test` this make is nested (MAKELEVEL > 0) and
            # would otherwise print "make[1]: Entering directory ..." first.
            [make, "--no-print-directory", "-n", "install", f"VENV={venv}", *extra],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return [line for line in out.splitlines() if not line.startswith("#")]

    default = recipe()
    assert default[0].split() == ["python3", "-m", "venv", str(venv)]
    assert any('pip install -q "torch==' in line for line in default)

    system = recipe("SYSTEM_TORCH=1")
    assert system[0].split() == ["python3", "-m", "venv", "--system-site-packages", str(venv)]
    pip_lines = [line for line in system if "-m pip install" in line]
    requirements = [arg for line in pip_lines for arg in shlex.split(line)]
    assert not [r for r in requirements if re.match(r"torch\b", r)], pip_lines
    constraints = f"{venv}/system-torch-constraints.txt"
    # make install is the runtime alone: the product, editable, without the dev extra
    editable = [line for line in pip_lines if line.endswith(" -e .")]
    assert len(editable) == 1 and f"-c {constraints}" in editable[0]
    assert all("--no-deps" in line for line in pip_lines if line not in editable)
    # the check writing the constraints runs before pip, and again after it
    checks = [i for i, line in enumerate(system) if "SYSTEM_TORCH_CHECK" in line]
    assert len(checks) == 2 and checks[0] < system.index(editable[0]) < checks[1]


def test_make_install_system_torch_keeps_the_system_torch(tmp_path: Path) -> None:
    """The real recipe, offline. The "system" torch: this interpreter's site-packages (torch and
    every dependency) on PYTHONPATH, behind a torch dist-info with a JetPack-style version
    (pre-release + local label), which is what pip sees as the installed torch. pip may not
    reach an index and builds the editable package without isolation (no download)."""
    make = _make()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("Makefile", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("shared", "edge_agent", "cloud_verifier"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    jetpack = "2.5.0a0+872d972e41.nv24.8"
    fake = tmp_path / "system"
    dist = fake / f"torch-{jetpack}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {jetpack}\n")
    (dist / "RECORD").write_text("")
    site = sysconfig.get_paths()["purelib"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(
        PYTHONPATH=f"{fake}{os.pathsep}{site}",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_NO_BUILD_ISOLATION="0",  # i.e. no isolation: setuptools comes from PYTHONPATH
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    venv = tmp_path / "v"
    base = getattr(sys, "_base_executable", sys.executable)
    proc = subprocess.run(
        [make, "install", "SYSTEM_TORCH=1", f"VENV={venv}", f"PYTHON={base}"],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "system torch" in proc.stdout
    assert (venv / ".installed").exists()
    cfg = (venv / "pyvenv.cfg").read_text()
    assert re.search(r"^include-system-site-packages\s*=\s*true$", cfg, re.M), cfg
    pins = (venv / "system-torch-constraints.txt").read_text().split()
    assert pins[0] == f"torch=={jetpack}"
    # nothing of torch inside the venv: pip kept the one it found outside
    inside = [p.name for p in venv.rglob("*") if p.name.lower().startswith("torch")]
    assert inside == [], inside
    # the project itself is installed (editable) and importable from the venv
    assert list(venv.glob("lib/python*/site-packages/__editable__*wanspec*"))


def test_make_install_system_torch_without_torch_fails_clearly(tmp_path: Path) -> None:
    """No torch to reuse: the recipe stops at once with a message, before pip runs."""
    make = _make()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    # offline, whatever happens: pip may not reach an index or the machine's pip settings
    env.update(PYTHONNOUSERSITE="1", PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    base = getattr(sys, "_base_executable", sys.executable)
    probe = subprocess.run(
        [base, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.stdout.strip() != "True":
        pytest.skip("the base interpreter has a torch of its own")
    proc = subprocess.run(
        [make, "install", "SYSTEM_TORCH=1", f"VENV={tmp_path / 'v'}", f"PYTHON={base}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "SYSTEM_TORCH=1: no torch importable" in proc.stderr
    assert "-m pip install" not in proc.stdout  # make stopped before pip
    assert not (tmp_path / "v" / ".installed").exists()


def test_cli_parsers_still_take_the_unit_flags() -> None:
    # the flags the units pass exist (a rename in the CLI would break the units)
    p = verifier_cli.build_parser()
    a = p.parse_args(["serve", "--token-file", "t", "--tls-cert", "c", "--tls-key", "k"])
    assert isinstance(a, argparse.Namespace) and a.tls_key == "k"
    e = edge_cli.build_parser().parse_args(["serve", "--token-file", "t", "--api-key-file", "k"])
    assert e.api_key_file == "k"


# ----------------------------------------------------------------------------- model pairs


def test_install_writes_the_models_of_a_pair(root: Path, prefix: Path) -> None:
    """``--target`` (cloud) and ``--draft``/``--draft-base`` (edge) go into the new settings
    files, read back as the units read them; a kept file is named, not rewritten."""
    token = root / "given-token"
    token.write_text("edge-secret\n")
    run_install(root, "cloud", "--behind-proxy", "--target", "/srv/models/Qwen3-32B")
    unit = root / "etc" / "systemd" / "system" / "cloud-verifier.service"
    creds = load_credentials(root, unit)
    args = verifier_cli.build_parser().parse_args(service_argv(root, unit, creds))
    assert verifier_cli.load_cli_settings(args, {}).model == "/srv/models/Qwen3-32B"
    kept = run_install(root, "cloud", "--behind-proxy", "--target", "Qwen/Qwen3-32B")
    assert "--target Qwen/Qwen3-32B not written" in kept.stderr
    assert 'model = "/srv/models/Qwen3-32B"' in (root / "etc/wanspec/verifier.toml").read_text()

    url = "wss://verifier.example:8765/v1/session"
    draft = ["--draft", "/srv/models/Qwen3-0.6B", "--draft-base", "Qwen/Qwen3-0.6B"]
    run_install(
        root, "edge", "--prefix", str(prefix), "--token", str(token), "--verifier", url, *draft
    )
    unit = root / "etc" / "systemd" / "system" / "edge-agent.service"
    creds = load_credentials(root, unit)
    args = edge_cli.build_parser().parse_args(service_argv(root, unit, creds))
    settings = edge_cli.load_cli_settings(args, {})
    assert settings.verifier == url and settings.draft == "/srv/models/Qwen3-0.6B"
    assert settings.draft_base == "Qwen/Qwen3-0.6B"
    kept = run_install(root, "edge", "--draft", "/srv/models/other")
    assert "--draft /srv/models/other not written" in kept.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["edge", "--draft", 'a"b'], "no spaces, quotes or backslashes"),
        (["edge", "--draft", "a b"], "no spaces, quotes or backslashes"),
        (["edge", "--draft-base", "a\\b"], "no spaces, quotes or backslashes"),
        (["edge", "--target", "x"], "--target are cloud options"),
        (["cloud", "--behind-proxy", "--draft", "x"], "--draft-base are edge options"),
    ],
)
def test_install_refuses_bad_model_options(root: Path, args: list[str], error: str) -> None:
    token = root / "t"
    token.write_text("x\n")
    url = ["--token", str(token), "--verifier", "wss://v.example:8765/v1/session"]
    bad = run_install(root, *args, *(url if args[0] == "edge" else []), check=False)
    assert bad.returncode == 2 and error in bad.stderr
    assert not (root / "etc" / "wanspec").exists()
