"""A small Dockerfile and .dockerignore reader for the static image checks (no Docker engine here)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by Docker too
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    out = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def stages(text: str) -> list[Stage]:
    result: list[Stage] = []
    for keyword, args in instructions(text):
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args, flags=re.IGNORECASE)
            assert match, f"cannot read FROM {args}"
            result.append(Stage(name=match[2] or str(len(result)), base=match[1]))
        elif result:
            result[-1].instructions.append((keyword, args))
    return result


def exec_form(args: str) -> list[str]:
    """The JSON (exec) form of ENTRYPOINT/CMD; the shell form is refused (signals would go to sh)."""
    value = json.loads(args)
    assert isinstance(value, list), args
    return [str(v) for v in value]


def copy_sources(args: str) -> tuple[list[str], bool]:
    """(sources, from_another_stage) of a COPY instruction."""
    words = shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    paths = [w for w in words if not w.startswith("--")]
    return paths[:-1], any(f.startswith("--from=") for f in flags)


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex on slash-separated paths."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


class DockerIgnore:
    """Docker's rule: the last matching pattern wins; a pattern matching a folder matches what is in it."""

    def __init__(self, text: str) -> None:
        self.rules: list[tuple[re.Pattern[str], bool]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            body = line[1:].strip() if negated else line
            body = body.strip("/") if body not in ("/", "") else body
            self.rules.append((_pattern(body), negated))

    def excluded(self, path: str) -> bool:
        parts = path.strip("/").split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        verdict = False
        for regex, negated in self.rules:
            if any(regex.fullmatch(p) for p in prefixes):
                verdict = not negated
        return verdict


def files_under(root: Path, rel: str) -> list[str]:
    path = root / rel
    if path.is_file():
        return [rel]
    return [str(p.relative_to(root)) for p in path.rglob("*") if p.is_file()]
