"""Token files that no client could send are refused at the start.

Scenario: an operator writes the daemon's --auth-token-file by hand (an
editor's CRLF, a second line, a pasted non-ASCII character, an empty file).
Before, an empty or blank file ended in a traceback with exit code 1 (the
systemd unit restarts on 1, for ever; it stops on 2), and a two-line or
non-ASCII token started, reported SERVING and then failed every call in the
client with INTERNAL "Invalid metadata". Each must stop the start with exit
code 2 and one line naming the file and the problem.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from probes import AS_LIMIT_BYTES

_LIMIT = AS_LIMIT_BYTES
_ENTRY = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({_LIMIT}, {_LIMIT})); "
          "from reducerd.__main__ import main; sys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize(("content", "problem"), [
    (b"", "is empty"),
    (b"\n", "holds only blanks and line ends"),
    (b"  \r\n \r\n", "holds only blanks and line ends"),
    (b"first\nsecond\n", "holds 2 lines"),
    (b"s3cret\r\nother\r\n", "holds 2 lines"),
    ("s3cr\u00e9t\n".encode(), "non-ASCII byte (0xc3 at byte 4)"),
    ("\u4ee4\u724c\n".encode(), "non-ASCII byte (0xe4 at byte 0)"),
    (b"s3c ret\n", "holds ' ' at character 3"),
    (b"s3c\x01ret\n", "holds '\\x01' at character 3"),
], ids=["empty", "newline", "blanks-crlf", "two-lines", "two-lines-crlf", "latin1",
        "cjk", "inner-space", "control"])
def test_a_token_file_no_client_could_send_is_refused_at_the_start(tmp_path, content,
                                                                   problem):
    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    done = subprocess.run(
        [sys.executable, "-c", _ENTRY, "--listen", "127.0.0.1:0", "--auth-token-file",
         str(token_file)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr  # one line, no traceback
    assert lines[0].startswith(f"reducerd: auth_token_file: '{token_file}' "), lines[0]
    assert problem in lines[0], lines[0]
    assert "listening" not in done.stdout + done.stderr


def test_a_token_with_crlf_and_blanks_around_it_is_the_token_alone(tmp_path):
    """The line end and blanks around the token are not part of it (an editor's CRLF)."""
    from reducerd.ops.token_file import read_token_file

    token_file = tmp_path / "token"
    token_file.write_bytes(b"  s3cret \r\n")
    assert read_token_file(str(token_file)) == "s3cret"


def test_reducerd_token_refuses_the_same_files(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_bytes(b"a\nb\n")
    done = subprocess.run(
        [sys.executable, "-m", "reducerd", "token", "--job", "j", "--auth-token-file",
         str(token_file)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"reducerd token: --auth-token-file: '{token_file}' "
                                   "holds 2 lines: a token is one line")
