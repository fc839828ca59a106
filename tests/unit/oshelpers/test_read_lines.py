"""Reading a log's lines for `logs`: each line bounded (a 90 MB line must not cost a reader
90 MB), and a rotated log read with its older part first."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from fleetserve.oshelpers import files
from fleetserve.oshelpers.files import (
    MAX_LINE_CHARS,
    LineSplitter,
    lines_naming,
    read_lines,
    rotate_log,
    rotated_part,
    while_alive,
)


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


def test_a_rotated_part_does_not_start_with_a_piece_of_a_line(tmp_path: Path) -> None:
    """rotate_log cuts at a byte (mid-line, even mid-character): a full read leaves out the
    piece before the first line break of `.1`, as a tail does (found by an outside review)."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"record {i:03d} " + "é" * 20 + "\n" for i in range(100)))
    assert rotate_log(log, cap_bytes=2 * 1001) is not None
    for tail in (None, 1000):
        got = lines_of(log, tail)
        assert got and all(line.startswith("record ") for line in got), tail
        assert got[-1].startswith("record 099 ")


def follow_while(
    log: Path,
    act: Callable[[], Awaitable[object]],
    settle: float = 0.6,
    *,
    tail: int | None = None,
    start: float = 0.4,
    stall_after: int = 0,
    stall: float = 0.0,
) -> list[str]:
    """What a follower of `log` read while `act()` ran (`start` seconds after it began), and
    `settle` seconds after; its client stalls `stall` seconds after its `stall_after`th line
    (a slow client: the follower waits at a yield)."""

    async def run() -> list[str]:
        out: list[str] = []

        async def follow() -> None:
            async for line in read_lines(log, follow=True, tail=tail):
                out.append(line)
                if len(out) == stall_after:
                    await asyncio.sleep(stall)

        task = asyncio.create_task(follow())
        await asyncio.sleep(start)
        await act()
        await asyncio.sleep(settle)
        task.cancel()
        return out

    return asyncio.run(run())


def test_a_long_line_followed_as_it_is_written_comes_once_cut(tmp_path: Path) -> None:
    """A follower at the end of a file whose long line is still being written waits for its
    end and shows it once, cut (it came as one cut line per read, then an empty one)."""
    log = tmp_path / "replica-1.log"
    log.write_text("")

    async def act() -> None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        try:
            for _ in range(3):
                os.write(fd, b"z" * (MAX_LINE_CHARS + 1000))
                await asyncio.sleep(0.4)
            os.write(fd, b"\nnext\n")
        finally:
            os.close(fd)

    out = follow_while(log, act)
    assert len(out) == 2, [line[-60:] for line in out]
    assert out[0].endswith(f" [... line cut: {2 * MAX_LINE_CHARS + 3000} more characters]\n")
    assert out[1] == "next\n"


def test_a_tail_of_one_huge_unended_line_shows_its_end_cut(tmp_path: Path) -> None:
    log = tmp_path / "replica-1.log"
    log.write_text("q" * 3_000_000)
    assert len(lines_of(log)) == 1
    got = lines_of(log, tail=5)
    assert len(got) == 1 and got[0].startswith("[... line cut] q")
    assert len(got[0]) < MAX_LINE_CHARS + 100


def test_a_rotation_cut_on_a_line_boundary_keeps_every_line(tmp_path: Path) -> None:
    """`.1` starts with a whole line, whether the cut fell between two lines or inside one:
    no reader has to drop a piece, and no whole line is dropped (second review)."""
    for size in (10, 13):  # 200 / 2 falls on a boundary of 10-byte lines, not of 13-byte ones
        log = tmp_path / f"r{size}.log"
        log.write_text("".join(f"line {i:0{size - 6}d}\n" for i in range(100)))
        assert rotate_log(log, cap_bytes=200) is not None
        with open(log, "a") as f:
            f.write("after\n")
        got = lines_of(log)
        assert got[-1] == "after\n" and all(line.startswith("line ") for line in got[:-1])
        numbers = [int(line.split()[1]) for line in got[:-1]]
        assert numbers == list(range(numbers[0], 100)), size
        assert 100 - numbers[0] == 100 // size, size  # all the whole lines of the kept half
        assert lines_of(log, tail=50) == got


def test_a_long_line_held_at_a_rotation_is_shown_not_lost(tmp_path: Path) -> None:
    log = tmp_path / "replica-1.log"
    log.write_text("first\n")

    async def act() -> None:
        with open(log, "a") as f:
            f.write("A" * (MAX_LINE_CHARS + 5000))
        await asyncio.sleep(0.5)
        rotate_log(log, cap_bytes=100)
        with open(log, "a") as f:
            f.write("tail-of-A\nnext\n")

    out = follow_while(log, act)
    assert out[0] == "first\n"
    assert out[1].startswith("AAAA") and "line cut" in out[1]
    assert out[-1] == "next\n"


def test_a_long_unended_last_line_is_shown_to_a_follower(tmp_path: Path) -> None:
    """A process that stopped in the middle of a long line (a crash mid-dump): a follower
    shows the line, cut, after a second without more of it."""
    log = tmp_path / "replica-1.log"
    log.write_text("first\n" + "B" * (MAX_LINE_CHARS + 10))

    async def act() -> None:
        return None

    out = follow_while(log, act, settle=1.6)
    assert out == ["first\n", "B" * MAX_LINE_CHARS + " [... line cut: 10 more characters]\n"]


def test_the_tail_of_one_huge_line_shows_its_real_end(tmp_path: Path) -> None:
    log = tmp_path / "replica-1.log"
    log.write_text("q" * 3_000_000 + "THE-END")
    got = lines_of(log, tail=5)
    assert len(got) == 1 and got[0].endswith("THE-END") and "more characters" not in got[0]


def test_lines_written_just_before_a_rotation_reach_a_follower(tmp_path: Path) -> None:
    """Lines written after a follower's last read and moved away by a rotation before its next
    one are read from `<name>.1` (they used to be lost to it), once each, in order; and
    lines equal to ones it already showed are not taken for them."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"old {i}\n" for i in range(50)))

    async def act() -> None:
        with open(log, "a") as f:  # the same text as shown lines, then new ones, no poll between
            f.write("old 49\n" + "".join(f"new {i}\n" for i in range(30)))
        rotate_log(log, cap_bytes=800)
        with open(log, "a") as f:
            f.write("after 1\nafter 2\n")

    out = follow_while(log, act)
    assert out[:50] == [f"old {i}\n" for i in range(50)]
    assert out[50:] == ["old 49\n", *(f"new {i}\n" for i in range(30)), "after 1\n", "after 2\n"]


def test_a_changed_or_deleted_older_part_is_not_taken_for_a_rotation(tmp_path: Path) -> None:
    """Only a rotation makes a follower read again (review: a deleted, touched or half-written
    `.1` made it print the whole log a second time)."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"old {i}\n" for i in range(50)))
    rotated_part(log).write_text("older\n")

    async def act() -> None:
        rotated_part(log).unlink()
        await asyncio.sleep(0.3)
        rotated_part(log).write_text("something else\n")
        await asyncio.sleep(0.3)
        with open(log, "a") as f:
            f.write("next\n")

    out = follow_while(log, act)
    assert out == ["older\n", *(f"old {i}\n" for i in range(50)), "next\n"]


def test_a_slow_rotation_is_followed_once_its_log_is_emptied(tmp_path: Path) -> None:
    """rotate_log's steps with polls between them: `.1` written (nothing happens yet), the
    log emptied and the rotation recorded a moment later; then repetitive lines around an
    error: the follower goes by byte positions, so the error between equal lines comes."""
    log = tmp_path / "replica-1.log"
    health = 'INFO:     127.0.0.1:40000 - "GET /health HTTP/1.1" 200 OK\n'
    log.write_text(health * 100)

    async def act() -> None:
        with open(log, "a") as f:
            f.write("ERROR: out of memory\n" + health * 3)
        log_id = files._file_id(os.stat(log))
        start, kept, part = files._write_tail(log, rotated_part(log), log.stat().st_size - 600)
        await asyncio.sleep(0.5)
        _, record = files._begin_rotation(log_id)
        await asyncio.sleep(0.3)  # (a poll in between: nothing is read meanwhile)
        os.truncate(log, 0)
        await asyncio.sleep(0.02)
        files._end_rotation(log_id, record, start, start + kept, start + kept, part)
        with open(log, "a") as f:
            f.write("after\n")

    out = follow_while(log, act)
    assert out == [health] * 100 + ["ERROR: out of memory\n", *[health] * 3, "after\n"]


def test_missed_lines_are_decoded_as_the_follower_decodes_and_two_rotations_are_said(
    tmp_path: Path,
) -> None:
    log = tmp_path / "replica-1.log"
    log.write_bytes(b"".join(b"win %d\r\n" % i for i in range(50)))

    async def act() -> None:
        with open(log, "ab") as f:
            f.write(b"missed\r\nbad \xff byte\r\n")
        rotate_log(log, cap_bytes=400)
        with open(log, "ab") as f:
            f.write(b"after\r\n" * 40)
        rotate_log(log, cap_bytes=200)  # a second one before the follower reads again
        with open(log, "ab") as f:
            f.write(b"last\r\n")

    out = follow_while(log, act)
    assert out[:50] == [f"win {i}\n" for i in range(50)]
    assert out[50] == "[... this log was rotated more than once between two reads]\n"
    assert out[51:] == ["last\n"]

    async def once() -> None:
        with open(log, "ab") as f:
            f.write(b"missed\r\nbad \xff byte\r\n")
        rotate_log(log, cap_bytes=50)

    out = follow_while(log, once)
    assert out[-2:] == ["missed\n", "bad \ufffd byte\n"]


def test_a_follower_from_a_tail_finds_its_place_after_a_rotation(tmp_path: Path) -> None:
    """`logs --tail N` then follow: what came after the tail and before a rotation is shown;
    a follower that read nothing of a log rotated at once gets its whole older part."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"old {i}\n" for i in range(50)))

    async def run() -> list[str]:
        out: list[str] = []

        async def follow() -> None:
            async for line in read_lines(log, follow=True, tail=2):
                out.append(line)

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.4)
        with open(log, "a") as f:
            f.write("".join(f"new {i}\n" for i in range(5)))
        rotate_log(log, cap_bytes=100)
        with open(log, "a") as f:
            f.write("after\n")
        await asyncio.sleep(0.6)
        task.cancel()
        return out

    assert asyncio.run(run()) == [
        "old 48\n",
        "old 49\n",
        *(f"new {i}\n" for i in range(5)),
        "after\n",
    ]

    empty = tmp_path / "job.log"
    empty.write_text("")

    async def act() -> None:
        with open(empty, "a") as f:
            f.write("".join(f"line {i}\n" for i in range(20)))
        rotate_log(empty, cap_bytes=100)

    out = follow_while(empty, act)
    kept = rotated_part(empty).read_text().splitlines(keepends=True)
    lost = empty.stat().st_size  # (0: emptied)
    assert lost == 0 and kept
    # What no longer is anywhere is said, with its size, not passed over in silence.
    gone = sum(len(f"line {i}\n") for i in range(20)) - len(rotated_part(empty).read_bytes())
    assert out == [
        f"[... {gone} bytes of this log were rotated away before they were read]\n",
        *kept,
    ]


def test_a_long_line_at_a_rotation_is_not_shown_twice_and_the_lines_after_it_come(
    tmp_path: Path,
) -> None:
    log = tmp_path / "replica-1.log"
    log.write_text("first\n")

    async def act() -> None:
        with open(log, "a") as f:
            f.write("C" * (MAX_LINE_CHARS + 10))
        await asyncio.sleep(0.3)
        with open(log, "a") as f:
            f.write("C" * 10 + "\nafter C\n")
        rotate_log(log, cap_bytes=4 * MAX_LINE_CHARS)
        with open(log, "a") as f:
            f.write("next\n")

    out = follow_while(log, act)
    assert out[0] == "first\n"
    assert out[1].startswith("CCCC") and "line cut" in out[1]
    assert out[2:] == ["after C\n", "next\n"]


def in_thread(act: Callable[[], object]) -> Callable[[], Awaitable[object]]:
    """`act` run in a thread, as the controller runs rotate_log."""
    return lambda: asyncio.to_thread(act)


def follow_around(log: Path, act: Callable[[], object], settle: float = 0.8) -> list[str]:
    """As follow_while, with `act` run in a thread."""
    return follow_while(log, in_thread(act), settle)


def on_write_tail(
    monkeypatch: pytest.MonkeyPatch,
    before: Callable[[bytes | None], None] | None = None,
    after: Callable[[Path], None] | None = None,
) -> None:
    """rotate_log's copy (files._write_tail) with `before(data)` run first and `after(src)`
    run once it is written: a full disk, a slow disk, a writer between copy and truncation."""
    real = files._write_tail

    def write_tail(
        src: Path,
        dst: Path,
        start: int,
        data: bytes | None = None,
        before_replace: Callable[[], object] | None = None,
    ) -> tuple[int, int, tuple[int, int]]:
        if before is not None:
            before(data)
        done = real(src, dst, start, data, before_replace)
        if after is not None:
            after(src)
        return done

    monkeypatch.setattr(files, "_write_tail", write_tail)


def no_room(data: bytes | None = None) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_on_a_full_disk_a_late_record_of_the_rotation_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room to copy first: the log is emptied, then its end written back (slowly, to a
    disk that was full) and only then is the rotation recorded. The follower waits for the
    record instead of reading the emptied log as truncated by hand (which showed a false
    note and the end of the log twice)."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"old {i}\n" for i in range(50)))

    def full_then_slow(data: bytes | None) -> None:
        if data is None:
            no_room()  # (the copy)
        time.sleep(0.4)  # (the end, written back)

    on_write_tail(monkeypatch, before=full_then_slow)

    def act() -> None:
        with open(log, "a") as f:
            f.write("new 1\nnew 2\n")
        rotate_log(log, 400)
        with open(log, "a") as f:
            f.write("after\n")

    out = follow_around(log, act, settle=1.0)
    assert out == [*(f"old {i}\n" for i in range(50)), "new 1\n", "new 2\n", "after\n"]


def test_what_no_part_holds_is_said_where_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes written between the copy and the truncation, or a full disk with no room even
    for the end: lost to everyone, and the follower says so, in their place."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"old {i}\n" for i in range(50)))

    def more(src: Path) -> None:
        with open(src, "a") as f:  # the writer, between the copy and the truncation
            f.write("ERROR: between the copy and the truncation\n")

    on_write_tail(monkeypatch, after=more)

    def act() -> None:
        with open(log, "a") as f:
            f.write("new\n")
        rotate_log(log, 400)
        with open(log, "a") as f:
            f.write("after\n")

    out = follow_around(log, act)
    gone = len("ERROR: between the copy and the truncation\n")
    assert out[50:] == [
        "new\n",
        f"[... {gone} bytes of this log were rotated away before they were read]\n",
        "after\n",
    ]

    on_write_tail(monkeypatch, before=no_room)
    log = tmp_path / "replica-2.log"
    log.write_text("".join(f"old {i}\n" for i in range(50)))
    out = follow_around(log, act)
    assert out[50:] == [
        f"[... {len('new') + 1} bytes of this log were rotated away before they were read]\n",
        "after\n",
    ]


def test_a_follower_with_a_slow_client_inside_the_log_reads_none_of_the_new_one_as_old(
    tmp_path: Path,
) -> None:
    """Its client stalls after a few lines (the follower waits at a yield, a few KiB into
    the log) while the log is rotated and refilled past where it was: it goes on with the
    old log's lines, from `.1` once its own buffer is spent, then the new log from its start
    (it read the refilled log at its old offset, a line half old and half new, and later
    lines twice)."""
    log = tmp_path / "replica-1.log"
    old = [f"old {i:05d}\n" for i in range(3000)]  # 30,000 bytes
    log.write_text("".join(old))
    new = [f"new {i:05d}\n" for i in range(1000)]  # 10,000 bytes: past the follower's place

    def act() -> None:
        rotate_log(log, 50_000)  # `.1`: the last 25,000 bytes
        with open(log, "a") as f:
            f.write("".join(new))

    out = follow_while(log, in_thread(act), 1.5, start=0.2, stall_after=10, stall=0.6)
    assert out == old + new


def follow_stalled(log: Path, tail: int | None, act: Callable[[], object]) -> list[str]:
    """A follower whose client stalls after its first line, while `act()` runs in a thread."""
    return follow_while(log, in_thread(act), 1.0, tail=tail, start=0.1, stall_after=1, stall=0.5)


def test_a_rotation_while_the_tail_or_the_older_part_is_sent_is_followed(tmp_path: Path) -> None:
    """The log is opened (and its last rotation known) before its tail or `.1` is read: a
    rotation while they are sent to a slow client is seen, and what it moved is read from the
    new `.1`, which replaced the one being sent instead of being rewritten under it."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"old {i}\n" for i in range(50)))

    def act() -> None:
        with open(log, "a") as f:
            f.write("".join(f"new {i}\n" for i in range(20)))
        rotate_log(log, 400)
        with open(log, "a") as f:
            f.write("after\n")

    out = follow_stalled(log, 3, act)
    assert out == [
        "old 47\n",
        "old 48\n",
        "old 49\n",
        *(f"new {i}\n" for i in range(20)),
        "after\n",
    ]

    log = tmp_path / "replica-2.log"
    rotated_part(log).write_text("".join(f"older {i}\n" for i in range(10)))
    log.write_text("".join(f"old {i}\n" for i in range(50)))
    out = follow_stalled(log, None, act)
    assert out[:10] == [f"older {i}\n" for i in range(10)]  # the part it had opened, whole
    kept = rotated_part(log).read_text().splitlines(keepends=True)
    size = sum(len(f"old {i}\n") for i in range(50)) + sum(len(f"new {i}\n") for i in range(20))
    gone = size - len(rotated_part(log).read_bytes())  # (the log from its start, never read)
    assert out[10:] == [
        f"[... {gone} bytes of this log were rotated away before they were read]\n",
        *kept,
        "after\n",
    ]


def open_fds_on(path: Path) -> int:
    """How many of this process's descriptors are open on `path`."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                count += 1
    return count


def test_a_follow_whose_client_goes_away_while_the_log_is_quiet_closes_its_file(
    tmp_path: Path,
) -> None:
    """The API cancels a response whose client disconnected: a follow waiting for its next
    line (through while_alive, as `logs` runs it) closes its file and stops polling, instead
    of living on until the log's next line (forever, for a service taken down)."""
    log = tmp_path / "replica-1.log"
    log.write_text("first\n")

    async def run() -> tuple[int, int, int]:
        got: list[str] = []

        async def client() -> None:
            async for line in while_alive(read_lines(log, follow=True), lambda: True):
                got.append(line)

        before = open_fds_on(log)
        tasks = [asyncio.create_task(client()) for _ in range(5)]
        await asyncio.sleep(0.5)
        during = open_fds_on(log)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.3)
        assert got == ["first\n"] * 5
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return before, during, open_fds_on(log) + len(others)

    before, during, after = asyncio.run(run())
    assert during >= before + 5  # (the test sees the followers' files)
    assert after == before


def test_a_long_read_gives_the_event_loop_turns(tmp_path: Path) -> None:
    """A client reading a big log as fast as it comes never suspended the loop: the whole
    controller (health, the API, reconciling) waited for the read to end."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"line {i}\n" for i in range(5000)))

    async def run() -> tuple[int, int]:
        turns = 0
        stop = False

        async def ticker() -> None:
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        seen = 0
        async for _ in read_lines(log, follow=False):
            seen += 1
        during = turns
        stop = True
        await tick
        return seen, during

    seen, turns = asyncio.run(run())
    assert seen == 5000
    assert turns >= 5000 // files.YIELD_EVERY - 1


def test_a_read_without_follow_overtaken_by_a_rotation_goes_on_in_the_older_part(
    tmp_path: Path,
) -> None:
    log = tmp_path / "replica-1.log"
    old = [f"old {i:05d}\n" for i in range(2000)]  # 20,000 bytes
    log.write_text("".join(old))

    async def run() -> list[str]:
        out: list[str] = []
        async for line in read_lines(log, follow=False):
            out.append(line)
            if len(out) == 100:  # a slow client, a few KiB in
                await asyncio.to_thread(rotate_log, log, 30_000)  # `.1`: the last 15,000
                with open(log, "a") as f:
                    f.write("new\n" * 500)
        return out

    assert asyncio.run(run()) == old


def test_a_rotation_that_began_is_waited_for_before_anything_more_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower inside the log (its client slow) while the log is rotated, with a long
    gap between the rotation's start and the log's truncation: nothing of the log is read
    in that gap (it used to read the refilled log at its old offset when the record came
    after the truncation)."""
    log = tmp_path / "replica-1.log"
    old = [f"old {i:05d}\n" for i in range(3000)]
    log.write_text("".join(old))
    new = [f"new {i:05d}\n" for i in range(1000)]
    truncate = os.truncate

    def slow_truncate(path: object, length: int) -> None:
        time.sleep(0.3)
        truncate(path, length)  # type: ignore[arg-type]
        with open(log, "a") as f:  # the writer goes on at once
            f.write("".join(new))

    monkeypatch.setattr(os, "truncate", slow_truncate)
    rotate = in_thread(lambda: rotate_log(log, 50_000))
    out = follow_while(log, rotate, 1.0, start=0.05, stall_after=10, stall=0.1)
    assert out == old + new


def test_controller_lines_naming_a_service_come_whole(tmp_path: Path) -> None:
    """A line written in two pieces (a follower gives each as it comes) is matched whole:
    `logs --controller web` showed a cut line and lost the next one's head."""
    log = tmp_path / "controller.log"
    log.write_text("")

    async def run() -> list[str]:
        out: list[str] = []

        async def follow() -> None:
            async for line in lines_naming(log, "web", follow=True):
                out.append(line)

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        with open(log, "a") as f:
            f.write("10:00:01 ERROR launch of replica web/3 fai")
        await asyncio.sleep(0.5)
        with open(log, "a") as f:
            f.write("led\n10:00:02 service api: up\n10:00:03 service web: scaled up\n")
        await asyncio.sleep(0.5)
        task.cancel()
        return out

    assert asyncio.run(run()) == [
        "10:00:01 ERROR launch of replica web/3 failed\n",
        "10:00:03 service web: scaled up\n",
    ]


def test_a_log_that_is_a_fifo_or_a_link_is_not_read(tmp_path: Path) -> None:
    """A process that writes the log can put a FIFO (which blocked the event loop for good)
    or a link in its place: one line says the log cannot be read."""
    fifo = tmp_path / "replica-1.log"
    os.mkfifo(fifo)
    link = tmp_path / "replica-2.log"
    (tmp_path / "secret").write_text("secret\n")
    link.symlink_to(tmp_path / "secret")

    async def run(path: Path, follow: bool) -> list[str]:
        return [line async for line in read_lines(path, follow=follow)]

    for path in (fifo, link):
        for follow in (False, True):
            out = asyncio.run(asyncio.wait_for(run(path, follow), 5))
            assert len(out) == 1 and "cannot be read as a log" in out[0], (path, out)


def test_a_rotation_that_could_not_empty_the_log_leaves_its_readers_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The truncation fails after the rotation was published as begun: the rotation is
    undone, and a follower inside the log (its client slow) that stopped reading when it met
    the begun rotation goes on with the log (it stopped for good); no `.1` is left that
    copies what the log still holds."""
    log = tmp_path / "replica-1.log"
    old = [f"old {i:05d}\n" for i in range(3000)]
    log.write_text("".join(old))
    truncate = os.truncate

    def refused(path: object, length: int) -> None:
        time.sleep(0.4)  # (the follower reads meanwhile and meets the begun rotation)
        raise PermissionError(errno.EPERM, "Operation not permitted")

    def act() -> None:
        monkeypatch.setattr(os, "truncate", refused)
        with pytest.raises(PermissionError):
            rotate_log(log, 50_000)
        monkeypatch.setattr(os, "truncate", truncate)
        with open(log, "a") as f:
            f.write("next\n")

    out = follow_while(log, in_thread(act), 0.6, start=0.05, stall_after=10, stall=0.15)
    assert out == [*old, "next\n"]
    assert not rotated_part(log).exists()


def test_a_rotation_slower_than_the_wait_is_not_taken_for_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A truncation that takes longer than ROTATION_WAIT: the follower keeps waiting (it read
    the whole, not yet emptied, log again when it gave up), and then gets only what comes."""
    log = tmp_path / "replica-1.log"
    log.write_text("".join(f"line {i}\n" for i in range(200)))
    truncate = os.truncate
    monkeypatch.setattr(files, "ROTATION_WAIT", 0.5)

    def slow(path: object, length: int) -> None:
        time.sleep(1.2)
        truncate(path, length)  # type: ignore[arg-type]

    def act() -> None:
        monkeypatch.setattr(os, "truncate", slow)
        rotate_log(log, 2000)
        monkeypatch.setattr(os, "truncate", truncate)
        with open(log, "a") as f:
            f.write("after\n")

    assert follow_while(log, in_thread(act), 0.6, tail=0, start=0.3) == ["after\n"]
