"""The npm packages `fedlang serve` hands to browsers, pinned and SHA-256 checked (nothing
comes from a CDN).

Each `Package` names files of one npm package at one version, each with its SHA-256:
onnxruntime-web's WebAssembly backend (14 MB, for browser clients: `fedlang serve
--browser`) and uPlot (the dashboard's charts, 150 KB). They are not kept in the
repository. `Package.install()` takes them, each checked, from a directory that already
holds them, or else from the package's tarball on npm's registry (`REGISTRY/NAME/-/
NAME-VERSION.tgz`, read with the standard library: no npm needed), or else with npm,
and copies them into the Python package (`Package.home`, e.g. `fedlang/deploy/browser/
static/ort/`).

Building a wheel runs the same step for every package of `PACKAGES` (`setup.py`'s
`build_py`), so every wheel holds the same checked files whatever ran before the build;
a build without network access takes them from the directory named by each package's
variable (`FEDLANG_ORT_DIR`, `FEDLANG_UPLOT_DIR`) or from a checkout where `python -m
fedlang.deploy.assets` (which `scripts/browser_setup.sh` runs) put them. An editable
install (`pip install -e .`) uses the checkout's copies, filled by that command. The same
variables point the server at another directory holding a package's files, and
`FEDLANG_NPM_REGISTRY` the download at another registry (a mirror).

This module imports only the standard library: the build loads it by path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import IO

REGISTRY = "https://registry.npmjs.org"
FEDLANG = pathlib.Path(__file__).resolve().parents[1]  # the fedlang package's directory


@dataclasses.dataclass(frozen=True)
class Package:
    """Files of one npm package at one version, checked by SHA-256.

    Attributes:
      name: the package's name on npm.
      version: the pinned version.
      files: each file's path inside the package (`dist/x.js`) -> its SHA-256 (hex). A
        file is stored under its base name; no two may share one.
      home: where the files go, relative to the fedlang package's directory.
      env: the environment variable naming another directory that holds the files.
      license: the package's license and author, for the README written beside them.
    """

    name: str
    version: str
    files: Mapping[str, str]
    home: str
    env: str
    license: str

    def __post_init__(self) -> None:
        if len(self.stored) != len(self.files):
            raise ValueError(f"Expected distinct base names in {sorted(self.files)}.")

    @property
    def stored(self) -> dict[str, str]:
        """Each file's base name (as stored) -> its SHA-256."""
        return {pathlib.PurePosixPath(path).name: digest for path, digest in self.files.items()}

    @property
    def readme(self) -> str:
        return (f"{self.name} {self.version} ({self.license}): files of npm's package, each "
                "checked against its pinned SHA-256 by fedlang.deploy.assets.\n")

    def directory(self) -> pathlib.Path:
        """Where the server looks for the files: `env`'s directory, else `home`."""
        return pathlib.Path(os.environ.get(self.env) or FEDLANG / self.home)

    def missing(self, directory: pathlib.Path | None = None) -> list[str]:
        """The files (base names) that `directory` lacks or holds in another version."""
        directory = pathlib.Path(directory or self.directory())
        out = []
        for name, digest in self.stored.items():
            path = directory / name
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
                out.append(name)
        return out

    def check(self) -> pathlib.Path:
        """The directory of the package's files.

        Raises:
          FileNotFoundError: naming the missing files and how to install them.
        """
        directory = self.directory()
        lacking = self.missing(directory)
        if lacking:
            raise FileNotFoundError(
                f"Expected {self.name} {self.version}'s files {lacking} in {directory}, found "
                "them missing or of another version; install them with `python -m "
                "fedlang.deploy.assets` (it downloads them from npm's registry; no npm "
                f"needed) or set {self.env} to a directory holding them."
            )
        return directory

    def tarball_url(self, registry: str | None = None) -> str:
        """The pinned tarball on `registry` (default: `FEDLANG_NPM_REGISTRY`, or npm's
        public registry)."""
        base = registry or os.environ.get("FEDLANG_NPM_REGISTRY") or REGISTRY
        tail = self.name.rsplit("/", 1)[-1]  # a scoped package's tarball drops the scope
        return f"{base.rstrip('/')}/{self.name}/-/{tail}-{self.version}.tgz"

    def _write(self, files: dict[str, bytes], destination: pathlib.Path) -> pathlib.Path:
        """Writes checked files (all of them) and the README; nothing else."""
        destination.mkdir(parents=True, exist_ok=True)
        for name in self.stored:
            (destination / name).write_bytes(files[name])
        (destination / "README.txt").write_text(self.readme)
        return destination

    def _checked(self, files: dict[str, bytes], where: str) -> dict[str, bytes]:
        bad = [n for n, digest in self.stored.items()
               if n not in files or hashlib.sha256(files[n]).hexdigest() != digest]
        if bad:
            raise RuntimeError(
                f"Expected {self.name} {self.version}'s files with their pinned SHA-256 in "
                f"{where}, found {bad} missing or differing; refusing them."
            )
        return files

    def from_tarball(self, tarball: IO[bytes], destination: pathlib.Path,
                     where: str = "the tarball") -> pathlib.Path:
        """Copies the files out of the package's tarball (`package/PATH`), reading no
        other member and writing nothing unless every file checks.

        Raises:
          RuntimeError: when a file is missing or differs from the pinned version's.
          tarfile.TarError: when `tarball` is not a gzipped tar file.
        """
        wanted = {f"package/{path}": pathlib.PurePosixPath(path).name for path in self.files}
        files: dict[str, bytes] = {}
        with tarfile.open(fileobj=tarball, mode="r:gz") as tar:
            for member in tar:
                if member.name in wanted and member.isfile():
                    extracted = tar.extractfile(member)
                    if extracted is not None:
                        files[wanted[member.name]] = extracted.read()
        return self._write(self._checked(files, where), destination)

    def fetch(self, destination: pathlib.Path, registry: str | None = None,
              timeout: float = 120) -> pathlib.Path:
        """Downloads the pinned tarball and copies its checked files to `destination`.

        Raises:
          urllib.error.URLError, OSError: when the registry cannot be reached.
          RuntimeError: when a file is not the pinned version's.
        """
        url = self.tarball_url(registry)
        with tempfile.TemporaryFile() as spool:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                shutil.copyfileobj(response, spool)
            spool.seek(0)
            return self.from_tarball(spool, destination, url)

    def install(self, destination: pathlib.Path | str | None = None, *,
                sources: Sequence[pathlib.Path | str] = (), registry: str | None = None,
                npm: str = "npm") -> pathlib.Path:
        """Puts the checked files in `destination` (default: `home` in the fedlang
        package), unless they are there already.

        They come from the first of `sources` (directories) that holds them all; else from
        the registry's tarball (`fetch`); else, when that fails and npm is installed, from
        `npm install` (which follows npm's own proxy and mirror settings). Every file is
        checked against its pinned SHA-256 whatever its source.

        Raises:
          FileNotFoundError: when no source is reachable, saying what was tried and what to do.
          RuntimeError: when a source's files are not the pinned version's.
        """
        destination = pathlib.Path(destination or FEDLANG / self.home)
        if not self.missing(destination):
            return destination
        for source in map(pathlib.Path, sources):
            if source.is_dir() and not self.missing(source):
                return self._write({n: (source / n).read_bytes() for n in self.stored}, destination)
        try:
            return self.fetch(destination, registry)
        except (urllib.error.URLError, OSError) as e:
            unreachable = f"{self.tarball_url(registry)} could not be downloaded ({e})"
        if shutil.which(npm) is None:
            raise FileNotFoundError(
                f"Expected {self.name} {self.version}'s files, found none: {unreachable}, and "
                "npm is not installed. Set FEDLANG_NPM_REGISTRY to a registry you can reach, or "
                f"put the package's files {sorted(self.files)} in a directory named by {self.env}."
            )
        return self._install_with_npm(destination, npm)

    def _install_with_npm(self, destination: pathlib.Path, npm: str) -> pathlib.Path:
        with tempfile.TemporaryDirectory(prefix="fedlang-npm-") as work:
            done = subprocess.run(
                [npm, "install", "--prefix", work, "--no-save", "--ignore-scripts", "--no-audit",
                 "--no-fund", "--loglevel=error", f"{self.name}@{self.version}"],
                capture_output=True, text=True, timeout=600,
            )
            if done.returncode != 0:
                raise RuntimeError(f"npm could not install {self.name}: {done.stderr[-2000:]}")
            root = pathlib.Path(work) / "node_modules" / self.name
            files = {pathlib.PurePosixPath(path).name: (root / path).read_bytes()
                     for path in self.files if (root / path).is_file()}
            return self._write(self._checked(files, str(root)), destination)


ORT_WEB = Package(  # the browser client's runtime: its WebAssembly backend
    name="onnxruntime-web",
    version="1.30.0",
    files={
        "dist/ort.wasm.min.mjs": "219e6a1fc8a9938268d18efca3c91d310bd2f4a59bbd13744df5b2b7fc6cee3b",
        "dist/ort-wasm-simd-threaded.mjs": "e13f7f94fc51b4ca72b12faeb1ee95f4ace6dfbc8939bc718aabdc0a27c4299b",
        "dist/ort-wasm-simd-threaded.wasm": "3398c10d07d229bd91b364548e130e0e51a8e5704b88c7c083ebbeb78842dee2",
    },
    home="deploy/browser/static/ort",
    env="FEDLANG_ORT_DIR",
    license="MIT License, Microsoft",
)
UPLOT = Package(  # the dashboard's charts: small, fast on live time series, no dependencies
    name="uplot",
    version="1.6.32",
    files={
        "dist/uPlot.esm.js": "5dd9b3281aa64b461b42d9945f6adb2649d346502b12281a9ae0d46599a80eba",
        "dist/uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
        "LICENSE": "8f989229699b4fe2f1a0432d0e9edc338a8a911e250e2d1b01ecd770a5f5b1bd",
    },
    home="deploy/server/static/uplot",
    env="FEDLANG_UPLOT_DIR",
    license="MIT License, Leon Sorokin",
)
PACKAGES = (ORT_WEB, UPLOT)


def main(argv: Sequence[str] | None = None) -> None:
    """Installs the packages named in `argv` (default: all of `PACKAGES`) into the
    fedlang package; exits 1, saying why, if one could not be installed."""
    names = list(sys.argv[1:] if argv is None else argv) or [p.name for p in PACKAGES]
    known = {p.name: p for p in PACKAGES}
    failed = False
    for name in names:
        if name not in known:
            print(f"fedlang: expected one of {sorted(known)}, found {name!r}.", file=sys.stderr)
            failed = True
            continue
        package = known[name]
        try:
            print(f"{package.name} {package.version} in {package.install()}")
        except (FileNotFoundError, RuntimeError, OSError, tarfile.TarError,
                subprocess.TimeoutExpired) as e:
            print(f"fedlang: {e}", file=sys.stderr)
            failed = True
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
