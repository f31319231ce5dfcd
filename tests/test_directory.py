"""The run's service directory (agentrl.common.directory): what a reader follows, and what it ignores."""

from __future__ import annotations

import os

import pytest

from agentrl.common.directory import (
    INFERENCE,
    LEARNER,
    DirectoryFollower,
    Move,
    read_directory,
    tools_key,
    write_directory,
)


def test_a_follower_reports_each_changed_entry_once_and_only_for_what_it_holds(tmp_path):
    path = tmp_path / "services.json"
    held = {INFERENCE: ["http://a:1", "http://b:1"], tools_key("search"): ["tcp://t:1"], LEARNER: ["tcp://l:1", "tcp://l:2"]}
    follower = DirectoryFollower(path, held)
    assert follower.moves() == []  # no file yet: nothing moved
    write_directory(path, held)
    assert follower.moves() == []
    write_directory(path, {**held, INFERENCE: ["http://a:1", "http://c:7", "http://extra:1"], "tools/other": ["tcp://o:1"],
                           LEARNER: ["tcp://m:1", "tcp://m:2"]})
    assert follower.moves() == [Move(INFERENCE, 1, "http://b:1", "http://c:7"),
                                Move(LEARNER, 0, "tcp://l:1", "tcp://m:1"), Move(LEARNER, 1, "tcp://l:2", "tcp://m:2")]
    assert follower.moves() == []  # the same file again: nothing new
    os.utime(path, ns=(1, 1))  # touched, same contents: nothing moved
    assert follower.moves() == []
    assert follower.held[INFERENCE] == ["http://a:1", "http://c:7"] and held[INFERENCE][1] == "http://b:1"


def test_a_file_that_is_not_a_directory_is_refused_and_the_endpoints_held_stay(tmp_path):
    path = tmp_path / "services.json"
    follower = DirectoryFollower(path, {INFERENCE: ["http://a:1"]})
    path.write_text("{half")
    assert follower.moves() == []
    with pytest.raises(ValueError, match="not JSON"):
        read_directory(path)
    path.write_text('{"inference": "http://b:1"}')
    with pytest.raises(ValueError, match="not a service directory"):
        read_directory(path)
    assert follower.moves() == [] and follower.held == {INFERENCE: ["http://a:1"]}
    with pytest.raises(ValueError, match="inference must be a list of endpoints"):
        write_directory(path, {INFERENCE: "http://b:1"})
    write_directory(path, {INFERENCE: ["http://b:1"]})
    assert follower.moves() == [Move(INFERENCE, 0, "http://a:1", "http://b:1")]
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename: no partial file left


def test_a_directory_that_cannot_be_read_now_is_read_again_at_the_next_look(tmp_path):
    """An I/O error (here: the path is a folder for a while) is not a look: the move written once it
    reads again is still reported."""
    path = tmp_path / "services.json"
    path.mkdir()
    follower = DirectoryFollower(path, {INFERENCE: ["http://a:1"]})
    assert follower.moves() == []
    path.rmdir()
    write_directory(path, {INFERENCE: ["http://b:1"]})
    assert follower.moves() == [Move(INFERENCE, 0, "http://a:1", "http://b:1")]
