"""The Docker sandbox image: a root filesystem holding only python3 (stdlib), built from this host's files.

Where no image registry is reachable (this project's CI and dev machines), `build_rootfs` writes a tarball of
the host's Debian `/usr/bin/python3.11`, its standard library and exactly the shared libraries `ldd` says they
need, plus a two-line /etc/passwd; `docker import` turns it into an image (about 75 MB, a few seconds). Where a
registry is reachable, `sandbox/Dockerfile` builds the equivalent image from `debian:bookworm-slim`. Either way
the image has no shell, no package manager and no compiler: the sandboxed program gets python3 and nothing else.

Stdlib only, so `.ci/setup-sandbox.sh` can run it with the system python before the project is installed:

    python3 sandbox/image.py /tmp/rootfs.tar                      # write the tarball
    python3 sandbox/image.py --import trustbatch-sandbox:py3.11    # write it and `docker import` it
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

DEFAULT_IMAGE = "trustbatch-sandbox:py3.11"
# `docker import --change` lines: the image runs as nobody with a minimal environment by default.
IMAGE_CHANGES = [
    "ENV PATH=/usr/bin LANG=C.UTF-8",
    "USER 65534:65534",
    "WORKDIR /tmp",
    'CMD ["python3"]',
]
# Parts of the stdlib a sandboxed program never needs; dropping them keeps the image small.
_SKIP_STDLIB = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "config-3.11-x86_64-linux-gnu",
}
_ETC_FILES = {
    "etc/passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hostname": "sandbox\n",
}


def _shared_libraries(paths: list[str]) -> set[str]:
    """Every shared library (as `ldd` names it) that the given executables and extension modules load."""
    libs: set[str] = set()
    for path in paths:
        out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        for line in out.splitlines():
            match = re.search(
                r"(/\S+) \(0x", line
            )  # "libc.so.6 => /lib/.../libc.so.6 (0x...)" or "/lib64/ld-... (0x...)"
            if match:
                libs.add(match.group(1))
    return libs


def _add_path(tar: tarfile.TarFile, path: str, seen: set[str]) -> None:
    """Add `path` at its canonical (merged-/usr) location, following a chain of symlinks and adding each link."""
    while True:
        canonical = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if canonical in seen:
            return
        seen.add(canonical)
        info = tar.gettarinfo(canonical, arcname=canonical.lstrip("/"))
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        if info.issym():
            tar.addfile(info)
            path = os.path.join(os.path.dirname(canonical), os.readlink(canonical))
            continue
        with open(canonical, "rb") as f:
            tar.addfile(info, f)
        return


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, mode
    tar.addfile(info)


def build_rootfs(out_path: str, python: str = "/usr/bin/python3") -> str:
    """Write a root filesystem tarball holding `python` (a Debian system python, not a venv), its stdlib and libs."""
    python = os.path.realpath(python)
    version = subprocess.run(
        [python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    stdlib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if stdlib.startswith(("/root", "/home")):
        raise ValueError(
            f"{python} keeps its stdlib under {stdlib}; use a system python (apt-get install python3)"
        )
    extensions = []
    seen: set[str] = set()
    with tarfile.open(out_path, "w") as tar:
        for name in (
            "usr",
            "usr/bin",
            "usr/lib",
            "usr/lib64",
            "usr/sbin",
            "etc",
            "dev",
            "proc",
            "sys",
            "run",
        ):
            _add_dir(tar, name)
        _add_dir(tar, "tmp", 0o1777)
        for link, target in (
            ("bin", "usr/bin"),
            ("lib", "usr/lib"),
            ("lib64", "usr/lib64"),
            ("sbin", "usr/sbin"),
        ):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for name, text in _ETC_FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        _add_path(tar, python, seen)
        for link in ("python3", f"python{version}"):
            info = tarfile.TarInfo(f"usr/bin/{link}")
            info.type, info.linkname = tarfile.SYMTYPE, os.path.basename(python)
            if info.name.lstrip("/") != python.lstrip("/"):
                tar.addfile(info)
        for root, dirs, files in os.walk(stdlib):
            dirs[:] = sorted(
                d for d in dirs if not (root == stdlib and d in _SKIP_STDLIB) and d != "site-packages"
            )
            for name in sorted(files):
                path = os.path.join(root, name)
                _add_path(tar, path, seen)
                if name.endswith(".so"):
                    extensions.append(path)
        for lib in sorted(_shared_libraries([python, *extensions])):
            _add_path(tar, lib, seen)
    return out_path


def import_image(tag: str = DEFAULT_IMAGE, python: str = "/usr/bin/python3") -> None:
    """Build the rootfs tarball and `docker import` it as `tag` (uses the docker CLI, as the CI script does)."""
    docker = shutil.which("docker")
    if docker is None:
        raise RuntimeError("the docker CLI is not installed: apt-get install docker.io")
    with tempfile.TemporaryDirectory() as tmp:
        tarball = build_rootfs(os.path.join(tmp, "rootfs.tar"), python)
        cmd = [docker, "import"]
        for change in IMAGE_CHANGES:
            cmd += ["--change", change]
        subprocess.run([*cmd, tarball, tag], check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", help="write the rootfs tarball here")
    parser.add_argument("--import", dest="tag", help="docker import the rootfs as this image tag")
    parser.add_argument(
        "--python", default="/usr/bin/python3", help="the system python to copy (default %(default)s)"
    )
    args = parser.parse_args(argv)
    if args.tag:
        import_image(args.tag, args.python)
        print(f"imported {args.tag}")
    elif args.out:
        print(build_rootfs(args.out, args.python))
    else:
        parser.error("give an output path or --import TAG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
