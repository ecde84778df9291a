"""What a command may read (regular files) and write (never over what it reads): groundtune.files,
on real files, links, a FIFO and a socket. The commands' own refusals are in test_bad_input.py."""

from __future__ import annotations

import os
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
