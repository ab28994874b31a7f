#!/usr/bin/env python3
"""Static checks of deploy/docker/Dockerfile, for machines without a Docker engine.

  * every RUN parses as bash (`bash -n`; the Dockerfile's SHELL is bash);
  * every COPY from the build context names files that exist and that
    Dockerfile.dockerignore does not exclude;
  * every COPY --from names an earlier stage;
  * the final stage runs as a numeric non-root USER with an exec-form
    ENTRYPOINT, and contains kvcache-node and kvcache-tool.
Exit status 0 when all hold, 1 otherwise.
"""
import fnmatch
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
IGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")


def instructions(text):
    out, cur = [], ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if cur and line.lstrip().startswith("#"):
            continue  # comment inside a continued instruction
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1]  # Docker drops backslash-newline
            continue
        cur += line
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def ignored(path, patterns):
    """Whether a .dockerignore excludes path (or a folder above it); last match wins."""
    parts = pathlib.PurePosixPath(path).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    hit = False
    for p in patterns:
        neg = p.startswith("!")
        p = p.lstrip("!").strip("/")
        globs = [p, p.removeprefix("**/")] if p.startswith("**/") else [p]
        for pre in prefixes:
            tail = pre.split("/")[-1]
            if any(fnmatch.fnmatchcase(pre, g) for g in globs) or \
                    (p.startswith("**/") and fnmatch.fnmatchcase(tail, globs[1])):
                hit = not neg
                break
    return hit


def main():
    global DOCKERFILE, IGNORE
    if len(sys.argv) > 1:
        DOCKERFILE = pathlib.Path(sys.argv[1]).resolve()
        IGNORE = ROOT / "deploy/docker/Dockerfile.dockerignore"
    errors = []
    ins = instructions(DOCKERFILE.read_text())
    patterns = [l.strip() for l in IGNORE.read_text().splitlines() if l.strip() and not l.startswith("#")]
    stages, final = [], None
    for word, rest in ins:
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.I)
            stages.append(m.group(1) if m else str(len(stages)))
            final = {"user": None, "entrypoint": None, "files": set()}
        elif word == "RUN":
            r = subprocess.run(["bash", "-n"], input=rest, capture_output=True, text=True)
            if r.returncode:
                errors.append(f"RUN does not parse: {r.stderr.strip()}\n    {rest[:200]}")
        elif word == "COPY":
            args = rest.split()
            opts = [a for a in args if a.startswith("--")]
            paths = [a for a in args if not a.startswith("--")]
            src, dst = paths[:-1], paths[-1]
            frm = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
            if frm:
                if frm[0] not in stages[:-1]:
                    errors.append(f"COPY --from={frm[0]}: no earlier stage of that name")
            else:
                for s in src:
                    if s == ".":
                        continue
                    if not (ROOT / s).exists():
                        errors.append(f"COPY {s}: no such file in the build context")
                    elif ignored(s, patterns):
                        errors.append(f"COPY {s}: excluded by {IGNORE.name}")
            for s in src:
                final["files"].add(dst.rstrip("/") + "/" + pathlib.Path(s).name if dst.endswith("/") else dst)
        elif word == "USER":
            final["user"] = rest
        elif word == "ENTRYPOINT":
            final["entrypoint"] = rest
    if final is None:
        errors.append("no FROM")
    else:
        user = (final["user"] or "").split(":")[0]
        if not user.isdigit() or user == "0":
            errors.append(f"final stage USER must be a numeric non-root uid, is {final['user']!r}")
        try:
            if not isinstance(json.loads(final["entrypoint"] or ""), list):
                raise ValueError
        except ValueError:
            errors.append("final stage ENTRYPOINT must be in exec (JSON) form")
        for b in ("kvcache-node", "kvcache-tool"):
            if not any(f.endswith("/" + b) for f in final["files"]):
                errors.append(f"final stage does not copy {b}")
    for e in errors:
        print(f"FAIL {e}")
    print(f"{'FAIL' if errors else 'ok'}: {len(ins)} instructions in {len(stages)} stages "
          f"({', '.join(stages)})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
