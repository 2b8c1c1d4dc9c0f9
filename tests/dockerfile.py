"""The repository's Dockerfile, run without a container engine: its
instructions parsed from the file and carried out on a Debian root file
system (made by scripts/debian_root.sh, as `FROM debian:RELEASE-slim`
would pull it), each `RUN` in a chroot with a clean environment, as a
builder runs it. Used by tests/integration/test_image.py, which then
starts nodes from that root.

Known instructions only (ARG, FROM, RUN, COPY, ENV, USER, WORKDIR,
EXPOSE, LABEL, ENTRYPOINT, CMD): anything else fails the parse, so the
test cannot silently skip a step the image would take. A `COPY --from`
of an earlier stage takes that stage's output from a directory the
caller gives (the wheel stage's `/wheels`: the wheel `maturin build`
made here, the same command that stage runs)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

KNOWN = {"ARG", "FROM", "RUN", "COPY", "ENV", "USER", "WORKDIR", "EXPOSE", "LABEL", "ENTRYPOINT", "CMD"}


@dataclass
class Stage:
    image: str  # FROM's image, its ARGs expanded
    name: str | None
    steps: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest of the line)


def _lines(text: str) -> list[str]:
    """Logical lines: continuations joined, comments and blank lines dropped."""
    out: list[str] = []
    cur = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def _expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)",
                  lambda m: env.get(m.group(1) or m.group(2), ""), text)


def parse(path: Path) -> list[Stage]:
    """The Dockerfile's stages in order."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _lines(path.read_text()):
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr not in KNOWN:
            raise ValueError(f"{path.name}: {instr} is an instruction the image test cannot run")
        if instr == "ARG" and not stages:
            key, _, default = rest.strip().partition("=")
            args[key] = default
        elif instr == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(_expand(words[0], args), name))
        else:
            if not stages:
                raise ValueError(f"{path.name}: {instr} before FROM")
            stages[-1].steps.append((instr, rest.strip()))
    return stages


def debian_release(image: str) -> str:
    """`debian:bookworm-slim` -> `bookworm`: the base the test can make with debootstrap."""
    m = re.fullmatch(r"debian:([a-z]+)-slim", image)
    if not m:
        raise ValueError(f"FROM {image}: the image test makes only debian:RELEASE-slim bases")
    return m.group(1)


@dataclass
class Image:
    """A root file system built from a stage, and how the image runs."""

    root: Path
    env: dict[str, str]
    user: str
    workdir: str
    entrypoint: list[str]
    cmd: list[str]
    exposed: list[str]


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload, no-any-return]


def build(stage: Stage, base: Path, root: Path, *, context: Path, stage_outputs: dict[str, dict[str, Path]],
          build_env: dict[str, str] | None = None, build_files: dict[str, Path] | None = None,
          log: list[str] | None = None) -> Image:
    """Carry out `stage`'s steps on a copy of `base` at `root`.

    `stage_outputs[stage][path]`: where an earlier stage's `path` is here.
    `build_env`, `build_files` ({path in the root: file here}): variables
    and files for RUN steps only (a build secret, e.g. the CA bundle pip
    must trust on this network), removed before the image is done."""
    if root.exists():
        shutil.rmtree(root)
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(root)], check=True, timeout=300)
    shutil.copy("/etc/resolv.conf", root / "etc" / "resolv.conf")  # as a builder does for RUN
    for inside, here in (build_files or {}).items():
        shutil.copy(here, root / inside.lstrip("/"))
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    user, workdir = "0:0", "/"
    entrypoint: list[str] = []
    cmd: list[str] = []
    exposed: list[str] = []
    for instr, rest in stage.steps:
        if log is not None:
            log.append(f"{instr} {rest}")
        if instr == "RUN":
            _chroot_run(root, rest, env={**env, **(build_env or {})}, user=user, workdir=workdir)
        elif instr == "COPY":
            _copy(root, rest, context=context, stage_outputs=stage_outputs, workdir=workdir)
        elif instr == "ENV":
            for word in shlex.split(rest):
                key, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"ENV {rest}: only the KEY=VALUE form is supported")
                env[key] = _expand(value, env)
        elif instr == "USER":
            user = rest if ":" in rest else f"{rest}:{rest}"
        elif instr == "WORKDIR":
            workdir = rest
            (root / rest.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif instr == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif instr == "CMD":
            cmd = json.loads(rest)
        elif instr == "EXPOSE":
            exposed.extend(rest.split())
        elif instr in ("LABEL", "ARG"):
            pass
    (root / "etc" / "resolv.conf").unlink()
    for inside in build_files or {}:
        (root / inside.lstrip("/")).unlink()
    return Image(root, env, user, workdir, entrypoint, cmd, exposed)


def _chroot_run(root: Path, script: str, *, env: dict[str, str], user: str, workdir: str) -> None:
    proc = root / "proc"
    subprocess.run(["mount", "-t", "proc", "proc", str(proc)], check=True, timeout=30)
    try:
        out = _run(["chroot", f"--userspec={user}", str(root), "/usr/bin/env", "-i",
                    *[f"{k}={v}" for k, v in env.items()], "/bin/sh", "-c", f"cd {shlex.quote(workdir)} && {script}"],
                   timeout=900)
    finally:
        subprocess.run(["umount", "-l", str(proc)], timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"RUN {script}\nexit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def _copy(root: Path, rest: str, *, context: Path, stage_outputs: dict[str, dict[str, Path]], workdir: str) -> None:
    words = rest.split()
    opts = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if w.startswith("--")}
    paths = [w for w in words if not w.startswith("--")]
    *sources, dest = paths
    if set(opts) - {"--from"}:
        raise ValueError(f"COPY {rest}: only --from is supported")
    target = root / (dest if dest.startswith("/") else os.path.join(workdir, dest)).lstrip("/")
    for src in sources:
        if "--from" in opts:
            where = stage_outputs[opts["--from"]][src]
        else:
            where = context / src
        if where.is_dir():
            shutil.copytree(where, target, dirs_exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(where, target if not dest.endswith("/") else target / where.name)
