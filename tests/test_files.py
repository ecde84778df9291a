"""What a command may read (regular files) and write (never over what it reads): groundtune.files,
on real files, links, a FIFO and a socket. The commands' own refusals are in test_bad_input.py."""

from __future__ import annotations

import os
import re
import socket

import pytest

from groundtune.errors import DataError, UsageError
from groundtune.files import not_an_input, regular_file, relation


def test_relation_sees_one_place_under_every_spelling(tmp_path):
    (tmp_path / "run" / "model").mkdir(parents=True)
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    os.symlink(data, tmp_path / "link.jsonl")
    os.link(data, tmp_path / "hard.jsonl")
    os.symlink(tmp_path / "run", tmp_path / "run-link")
    assert relation(data, tmp_path / "link.jsonl") == "is"
    assert relation(tmp_path / "hard.jsonl", data) == "is"  # a hard link: another name, the same file
    assert relation(tmp_path / "run" / ".." / "data.jsonl", data) == "is"
    assert relation(tmp_path, tmp_path / "run") == "holds"
    assert relation(tmp_path / "run-link" / "model", tmp_path / "run") == "lies inside"
    assert relation(tmp_path / "run" / "export", tmp_path / "run") == "lies inside"  # not there yet: resolved
    assert relation(tmp_path / "other", tmp_path / "run") is None
    assert relation(tmp_path / "runs", tmp_path / "run") is None  # a common prefix is no nesting


def test_an_output_is_refused_only_where_it_would_land_on_an_input(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    with pytest.raises(UsageError, match=r"^--fix-out \S+ is the file being checked \(\S+data\.jsonl\): writing it "
                                         r"would destroy what the command reads; choose another --fix-out$"):
        not_an_input(tmp_path / "." / "data.jsonl", "--fix-out", {"the file being checked": data})
    # a file written beside (or inside the folder of) what the command reads is fine
    assert not_an_input(tmp_path / "clean.jsonl", "--fix-out", {"the file being checked": data}) == tmp_path / "clean.jsonl"
    assert not_an_input(tmp_path / "out.jsonl", "--out", {"--images": tmp_path}) == tmp_path / "out.jsonl"
    # a folder output: neither holding nor inside an input
    with pytest.raises(UsageError, match=r"^out_dir=\S+ holds train_data"):
        not_an_input(tmp_path, "out_dir=", {"train_data": data}, folder=True)
    with pytest.raises(UsageError, match=r"lies inside --model"):
        not_an_input(tmp_path / "export", "--out", {"--model": tmp_path}, folder=True)
    assert not_an_input(tmp_path / "x", "--out", {"--model": None, "--data": ""}, folder=True) == tmp_path / "x"


def test_only_regular_files_are_opened(tmp_path):
    plain = tmp_path / "a.jsonl"
    plain.write_text("{}\n")
    assert regular_file(plain) == plain
    assert regular_file(tmp_path) == tmp_path  # a folder passes: its caller says what to give instead
    os.symlink(plain, tmp_path / "link")
    assert regular_file(tmp_path / "link") == tmp_path / "link"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DataError, match=r"fifo: a FIFO \(named pipe\), not a regular file; give the image itself"):
        regular_file(tmp_path / "fifo", "image")
    os.symlink(tmp_path / "fifo", tmp_path / "fifo-link")
    with pytest.raises(DataError, match="a FIFO"):
        regular_file(tmp_path / "fifo-link")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        with pytest.raises(DataError, match="a socket"):
            regular_file(tmp_path / "sock")
    with pytest.raises(DataError, match="a device"):
        regular_file("/dev/zero")
    with pytest.raises(FileNotFoundError):
        regular_file(tmp_path / "missing")


@pytest.mark.parametrize("path, said", [
    ("images/a\0b.png", r"^'images/a\\x00b\.png' holds a NUL byte, which no file name can$"),
    ("images/\ud800.png", r"is not text a file name can hold \(a lone surrogate\)$"),
    ("x" * 256, r"\(256 characters\) is longer than a file name can be \(a path of at most 4,096 bytes, each name at "
                r"most 255\)$"),
    ("/".join(["x" * 200] * 21), r"longer than a file name can be"),
])
def test_a_path_no_file_can_have_is_said_as_such(path, said):
    from groundtune.files import path_problem

    assert re.search(said, path_problem(path))


def test_a_path_a_file_can_have_passes():
    from groundtune.files import path_problem

    assert path_problem("images/é.png") is None and path_problem("x" * 255) is None
    assert path_problem("\udce9.png") is None  # a byte of a non-UTF-8 name, as Python spells it: a file may have it


def test_a_file_that_is_not_utf8_is_named_by_line_and_byte(tmp_path):
    from groundtune.files import not_utf8

    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "caf\xe9"}\n')
    assert str(not_utf8(path)) == f"{path}:2: not UTF-8 text (byte 0xE9 at byte offset 19); save the file as UTF-8"
    # a character cut by the end of a read, then a bad byte past the first MB
    path.write_bytes(b"x" * (2**20 - 1) + "é".encode() + b"\n\n" + b"\xff")
    assert str(not_utf8(path)).startswith(f"{path}:3: not UTF-8 text (byte 0xFF at byte offset {2**20 + 3:,})")
    path.write_bytes(b"ab\n\xc3")  # the file ends inside a character
    assert str(not_utf8(path)).startswith(f"{path}:2: not UTF-8 text (it ends inside a character, byte offset 4)")
    assert isinstance(not_utf8(path, UsageError), UsageError)


def test_an_output_file_is_a_previous_output_or_given_overwrite_and_never_an_input(tmp_path):
    from groundtune.files import output_file

    ours, theirs, image = tmp_path / "report.json", tmp_path / "notes.json", tmp_path / "a.png"
    ours.write_text('{"ours": true}\n')
    theirs.write_text("mine\n")
    image.write_bytes(b"\x89PNG")
    os.link(image, tmp_path / "hard.png")
    written = lambda path: b"ours" in path.read_bytes()  # noqa: E731
    reads = [("an image of --data", image)]
    assert output_file(tmp_path / "new.json", "--out", "eval", reads, written, False) == tmp_path / "new.json"
    assert output_file(ours, "--out", "eval", reads, written, False) == ours  # a previous output: replaced
    (tmp_path / "empty.json").write_text("")
    assert output_file(tmp_path / "empty.json", "--out", "eval", reads, written, False)  # nothing to lose
    with pytest.raises(UsageError, match=r"^--out \S+notes\.json exists and was not written by `groundtune eval`: "
                                         r"it would be replaced; choose another --out, or give --overwrite to replace "
                                         r"it$"):
        output_file(theirs, "--out", "eval", reads, written, False)
    assert output_file(theirs, "--out", "eval", reads, written, True) == theirs
    for name in ("a.png", "hard.png"):  # the image itself, or another name of it: never, --overwrite or not
        with pytest.raises(UsageError, match=r"is an image of --data \(\S+a\.png\): writing it would destroy"):
            output_file(tmp_path / name, "--out", "eval", reads, written, True)
    with pytest.raises(UsageError, match="is a folder; name the file to write"):
        output_file(tmp_path, "--out", "eval", reads, written, True)
