"""replace_atomically: what the loop state, the transcripts and the checkpoints rely on to never leave a torn file."""

from __future__ import annotations

from pathlib import Path

import pytest

from spade_mega.files import replace_atomically


def test_a_failed_write_leaves_the_previous_file_whole_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    replace_atomically(target, lambda f: f.write(b"old"))

    def fail(f) -> None:
        f.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        replace_atomically(target, fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    assert replace_atomically(target, lambda f: f.write(b"new")) == target and target.read_bytes() == b"new"
