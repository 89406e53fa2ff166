"""A page's code blocks as one shell script: what the docs tests run.

Blocks run in page order in one bash: `bash` blocks as they are (daemons
started with `&` keep running for the blocks after them), `python` blocks
fed to the interpreter, and a block with `title="FILE"` written to FILE in
the working directory instead. A block right after `<!-- not-run: REASON -->`
is skipped; the reason must say why it cannot run here. Every 127.0.0.1:PORT
on the page becomes a free port, the same one wherever the page repeats it,
and the script waits for a daemon's port after the block that starts it.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

BLOCK = re.compile(r"(?:<!-- not-run: (?P<reason>[^>]*?) -->\s*\n)?"
                   r"^```(?P<lang>\w+)(?P<attrs>[^\n]*)\n(?P<code>.*?)^```", re.M | re.S)
TITLE = re.compile(r'title="([^"]+)"')
LOCAL_PORT = re.compile(r"127\.0\.0\.1:(\d{2,5})\b")
RUNNABLE = ("bash", "python")
# Shown, not run: a command's output.
OUTPUT = ("text",)


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    title: str | None
    not_run: str | None  # the reason, for a block marked not runnable


def blocks(text: str) -> list[Block]:
    found = []
    for m in BLOCK.finditer(text):
        title = TITLE.search(m["attrs"])
        found.append(Block(m["lang"], m["code"], title[1] if title else None,
                           m["reason"].strip() if m["reason"] else None))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ports(text: str) -> dict[str, str]:
    """Each 127.0.0.1 port the page names -> a free port on this machine."""
    return {port: str(_free_port()) for port in dict.fromkeys(LOCAL_PORT.findall(text))}


def script(text: str, ports: dict[str, str], wait_s: float = 30.0) -> str:
    """The page's runnable blocks as one bash script (see the module doc)."""
    def local(code: str) -> str:
        return LOCAL_PORT.sub(lambda m: f"127.0.0.1:{ports.get(m[1], m[1])}", code)

    lines = ["set -euo pipefail",
             "cleanup() { for p in $(jobs -p); do kill -TERM $p 2>/dev/null || true; done; wait; }",
             "trap cleanup EXIT",
             f"wait_port() {{ for i in $(seq 1 {int(wait_s * 10)}); do "
             "(exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.1; done; "
             "echo \"nothing on 127.0.0.1:$1\" >&2; return 1; }"]
    for i, block in enumerate(blocks(text)):
        if block.not_run is not None or (block.lang not in RUNNABLE and not block.title):
            continue
        code = local(block.code)
        if block.title:
            lines += [f"cat > {block.title} <<'PAGE_BLOCK_{i}'", code.rstrip("\n"),
                      f"PAGE_BLOCK_{i}"]
        elif block.lang == "python":
            lines += [f"python - <<'PAGE_BLOCK_{i}'", code.rstrip("\n"), f"PAGE_BLOCK_{i}"]
        else:
            lines.append(code.rstrip("\n"))
            for line in code.splitlines():
                if line.rstrip().endswith("&"):
                    lines += [f"wait_port {port}" for port in LOCAL_PORT.findall(line)[:1]]
    return "\n".join(lines) + "\n"
