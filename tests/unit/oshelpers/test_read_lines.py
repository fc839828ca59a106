"""Reading a log's lines for `logs`: each line bounded (a 90 MB line must not cost a reader
90 MB), and a rotated log read with its older part first."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fleetserve.oshelpers.files import MAX_LINE_CHARS, LineSplitter, read_lines, rotate_log


def lines_of(path: Path, tail: int | None = None) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in read_lines(path, False, tail)]

    return asyncio.run(collect())


def test_a_huge_line_is_cut_with_a_note_and_the_next_line_follows(tmp_path: Path) -> None:
    log = tmp_path / "r.log"
    huge = "x" * (3 * MAX_LINE_CHARS + 17)
    log.write_text(f"before\n{huge}\nafter\n")
    for tail in (None, 3):
        got = lines_of(log, tail)
        assert got[0] == "before\n" and got[2] == "after\n", tail
        assert got[1].startswith("x" * 100)
        assert got[1].endswith(f" [... line cut: {2 * MAX_LINE_CHARS + 17} more characters]\n")
        assert len(got[1]) < MAX_LINE_CHARS + 100


def test_lines_at_the_bound_pass_whole(tmp_path: Path) -> None:
    log = tmp_path / "r.log"
    exact = "y" * MAX_LINE_CHARS
    log.write_text(f"{exact}\n{exact[:-1]}\nend")
    assert lines_of(log) == [f"{exact}\n", f"{exact[:-1]}\n", "end"]


def test_a_log_emptied_by_a_rotation_still_shows_its_last_lines(tmp_path: Path) -> None:
    """A job wrote its log, was rotated (its end moved to `.1`, the log truncated) and ended:
    `logs` shows the end kept in `.1`, then what came after."""
    log = tmp_path / "job.log"
    log.write_text("".join(f"line {i}\n" for i in range(200)))
    assert rotate_log(log, cap_bytes=1000) is not None
    assert log.stat().st_size == 0
    got = lines_of(log)
    assert got and got[-1] == "line 199\n"
    assert lines_of(log, tail=2) == ["line 198\n", "line 199\n"]
    with log.open("a") as f:
        f.write("after rotation\n")
    assert lines_of(log, tail=2) == ["line 199\n", "after rotation\n"]
    assert lines_of(log)[-2:] == ["line 199\n", "after rotation\n"]
    assert lines_of(log, tail=1) == ["after rotation\n"]


def test_lines_from_chunks_are_bounded_too() -> None:
    """A log read in chunks (the Ray infra's): lines split across chunks come whole, a line
    longer than the bound is cut with a note however many chunks it spans, and what is held
    of it meanwhile stays under the bound."""
    lines = LineSplitter()
    out = lines.feed("a\nb")
    assert out == ["a\n"]
    out = lines.feed("c\n" + "z" * MAX_LINE_CHARS)
    assert out == ["bc\n"]
    for _ in range(5):
        assert lines.feed("z" * MAX_LINE_CHARS) == []
        assert len(lines.pending) <= MAX_LINE_CHARS
    out = lines.feed("zz\nlast")
    assert len(out) == 1
    assert out[0].endswith(f" [... line cut: {5 * MAX_LINE_CHARS + 2} more characters]\n")
    assert lines.end() == ["last"]
    one = LineSplitter()
    assert one.feed("q" * (MAX_LINE_CHARS + 3) + "\n") == [
        "q" * MAX_LINE_CHARS + " [... line cut: 3 more characters]\n"
    ]
    assert one.end() == []


def test_a_long_log_with_long_lines_is_not_pieced_with_its_older_part(tmp_path: Path) -> None:
    """The last 256 KiB of a big log hold fewer lines than asked for: those are its last
    lines, nothing from `.1` (older than the rest of the log) is put before them."""
    log = tmp_path / "r.log"
    (tmp_path / "r.log.1").write_text("old line\n")
    log.write_text("".join(f"{i} {'w' * 40_000}\n" for i in range(20)))
    got = lines_of(log, tail=15)
    assert "old line\n" not in got
    assert got[-1].startswith("19 ")
