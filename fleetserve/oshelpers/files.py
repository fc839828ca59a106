"""Private files and logs: opening one for appending (owner-only), reading a log's lines (its
tail, following it as it grows or is rotated, those naming a service), and rotating a log
under a cap, also on a full disk. Used by the controller (its log, the replicas' and load
balancers' logs), the API (`logs`), the SDK (the controller's log) and the local infra."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import io
import os
import re
import stat
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, TextIO


def open_private(path: Path) -> int:
    """A file descriptor appending to `path`, created readable by its owner only. Logs are
    appended to, never truncated: a failed start must not wipe a running process's log."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


TAIL_WINDOW = 256 * 1024  # bytes read from a log's end to find its last lines
# The most of one line a reader holds: a process that writes a line of 90 MB (a dumped tensor,
# a base64 blob) must not cost every `logs` reader that much memory. The rest is skipped and
# counted in a note at the line's end.
MAX_LINE_CHARS = 64 * 1024
HELD_LINE_POLLS = 5  # a follower shows a long unended line after this many idle 0.2 s polls
MISSED_BYTES = 1024 * 1024  # the most a follower overtaken by a rotation reads back


def _cut(line: str, more: int) -> str:
    return f"{line.rstrip(chr(10))} [... line cut: {more} more characters]\n"


def _bounded(line: str) -> str:
    """A whole line (its newline, if any, not counted), cut past MAX_LINE_CHARS."""
    more = len(line.rstrip("\n")) - MAX_LINE_CHARS
    return _cut(line[:MAX_LINE_CHARS], more) if more > 0 else line


def tail_lines(path: Path, n: int) -> tuple[list[str], int]:
    """The last `n` lines of a log (from its last 256 KiB) and the offset of its end; read
    only as a regular file, never through a link (_open_regular)."""
    with _open_regular(path) as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        start = max(0, size - TAIL_WINDOW)
        f.seek(start)
        data = f.read(size - start)
    lines = data.decode(errors="replace").splitlines(keepends=True)
    if start > 0 and lines:
        if len(lines) == 1:
            # One line longer than the window: its end, said to be cut.
            mark = "[... line cut] "
            lines = [mark + lines[0][-(MAX_LINE_CHARS - len(mark)) :]]
        else:
            lines = lines[1:]  # the first one is cut
    return [_bounded(line) for line in (lines[-n:] if n > 0 else [])], size


class LineSplitter:
    """Lines out of text that comes in pieces (a log read in chunks from elsewhere), each at
    most MAX_LINE_CHARS long (cut with a note): what it holds of an unfinished line is
    bounded too."""

    def __init__(self) -> None:
        self.pending = ""
        self.head = ""  # what is kept of the line being cut
        self.skipped: int | None = None  # characters dropped of the line being cut

    def feed(self, text: str) -> list[str]:
        out = []
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        for line in lines:
            if self.skipped is not None:  # the end of a line already cut
                out.append(_cut(self.head, self.skipped + len(line)))
                self.skipped = None
            else:
                out.append(_bounded(line + "\n"))
        if len(self.pending) > MAX_LINE_CHARS:
            if self.skipped is None:
                self.head = self.pending[:MAX_LINE_CHARS]
                self.skipped = len(self.pending) - MAX_LINE_CHARS
            else:
                self.skipped += len(self.pending)
            self.pending = ""
        return out

    def end(self) -> list[str]:
        """What is left at the end of the text: an unfinished line."""
        if self.skipped is not None:
            return [_cut(self.head, self.skipped + len(self.pending))]
        return [self.pending] if self.pending else []


def rotated_part(path: Path) -> Path:
    """Where rotate_log keeps the older part of a log: `<name>.1`."""
    return path.with_name(path.name + ".1")


class _BoundedLines:
    """The lines of an open text file, each at most MAX_LINE_CHARS of it (the rest skipped
    and counted). Following a file that is still being written, a long line is waited for
    (across reads) until it ends, and comes once, cut."""

    def __init__(self, f: TextIO) -> None:
        self.f = f
        self.head: str | None = None  # the kept part of a long line being skipped
        self.more = 0  # characters of it skipped so far
        self.cut = False  # whether the last line returned was cut

    def reset(self) -> None:
        self.head, self.more = None, 0

    def held(self) -> str:
        """The long line being waited for, as far as it came (cut), and forget it; "" if
        none: shown when its file is rotated under it, or its writer stopped mid-line."""
        if self.head is None:
            return ""
        head, more = self.head, self.more
        self.reset()
        return _cut(head, more) if more else head

    def next(self, final: bool) -> str:
        """The next line; "" at the end of the file (`final`: there is no more to wait for,
        so a line not yet ended comes as far as it was written)."""
        f = self.f
        self.cut = False
        if self.head is None:
            line = f.readline(MAX_LINE_CHARS)
            if len(line) < MAX_LINE_CHARS or line.endswith("\n"):
                return line
            self.head = line
        while True:  # skip the rest of the line, a piece at a time
            piece = f.readline(MAX_LINE_CHARS)
            self.more += len(piece.rstrip("\n"))
            ended = piece.endswith("\n")
            if not ended and len(piece) == MAX_LINE_CHARS:
                continue
            if not ended and not final:
                return ""  # (the rest of this line is still to come)
            head, more = self.head, self.more
            self.reset()
            if more:
                self.cut = True
                return _cut(head, more)
            return head + "\n" if ended else head  # (exactly the bound)


@dataclass(frozen=True)
class _Rotation:
    """A rotation of a log by rotate_log in this process: its `<name>.1` (the file `part`)
    holds the log's bytes `start` to `end`; the log had `size` bytes when it was emptied
    (what lay past `end` is lost to everyone). Published twice with one `seq`: before the
    log is emptied (`done` false: nothing of the log is to be read meanwhile), then done."""

    seq: int  # this rotation's number, unique in the process
    after: int  # the seq of the log's rotation before it (0: none)
    start: int
    end: int
    size: int
    part: tuple[int, int] | None  # `<name>.1`'s (device, inode); None: no part was kept
    done: bool


# The last rotation of each log rotated in this process, by (device, inode): a follower reads
# what it had not read from `<name>.1` by these byte positions (its place in the log is a
# byte count too), not by matching text, which repeats in logs.
_ROTATIONS: collections.OrderedDict[tuple[int, int], _Rotation] = collections.OrderedDict()
_ROTATIONS_KEPT = 4096
_rotations_lock = threading.Lock()
_rotation_seq = 0
ROTATION_WAIT = 2.0  # how long a follower waits for a rotation it saw begin to be done
YIELD_EVERY = 256  # lines read between two turns given to the event loop


def _file_id(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _publish(log_id: tuple[int, int], record: _Rotation) -> None:
    with _rotations_lock:
        # (replaced in place, then moved: a reader without the lock never sees it missing)
        _ROTATIONS[log_id] = record
        _ROTATIONS.move_to_end(log_id)
        while len(_ROTATIONS) > _ROTATIONS_KEPT:
            _ROTATIONS.popitem(last=False)


def _begin_rotation(log_id: tuple[int, int]) -> tuple[_Rotation | None, _Rotation]:
    """The log's last rotation, and a new one published as begun (not done)."""
    global _rotation_seq
    with _rotations_lock:
        _rotation_seq += 1
        last = _ROTATIONS.get(log_id)
        record = _Rotation(_rotation_seq, last.seq if last else 0, 0, 0, 0, None, False)
    _publish(log_id, record)
    return last, record


def _end_rotation(
    log_id: tuple[int, int],
    record: _Rotation,
    start: int,
    end: int,
    size: int,
    part: tuple[int, int] | None,
) -> None:
    _publish(log_id, replace(record, start=start, end=end, size=size, part=part, done=True))


def _undo_rotation(log_id: tuple[int, int], last: _Rotation | None, record: _Rotation) -> None:
    """The log could not be emptied: it is as it was, and so is its record."""
    with _rotations_lock:
        if _ROTATIONS.get(log_id) is record:
            if last is None:
                del _ROTATIONS[log_id]
            else:
                _ROTATIONS[log_id] = last


def _open_regular(path: Path) -> BinaryIO:
    """A log or its `<name>.1` for reading: a regular file, never followed if a link, never
    waited on (a FIFO put in its place by a process that writes the log)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class _UntilRotated(io.RawIOBase):
    """A followed log's file, read as one stream of the old log's bytes across a rotation.

    A follower can be anywhere in the log when it is rotated (at its end, or inside it while
    its client reads slowly). Once the log has a rotation newer than `known`, no read takes
    the log's bytes any more (those at the old log's offsets would be the refilled log's);
    once that rotation is done, reads go on, from where the follower was, in `<name>.1`
    (which holds the rotated log's bytes `start` to `end`) when that is where they are, then
    end as at the end of a file (`drained`). `tell()` is the place in the old log: the
    follower then says what no part holds and reads the new log from its start (`renew`)."""

    def __init__(self, fd: int, older: Path) -> None:
        super().__init__()
        self.fd = fd
        self.older = older
        self.log_id = _file_id(os.fstat(fd))
        self.known = _ROTATIONS.get(self.log_id)
        if self.known is not None and not self.known.done:
            # Begun, not done: a rotation this reader will see; it knows the one before (so
            # that one, back in place if this one is undone, is not taken for a new one).
            self.known = replace(self.known, seq=self.known.after, done=True)
        self.seen: _Rotation | None = None  # the newer rotation a read met
        self.part: int | None = None  # `<name>.1`, read on from `at`
        self.tried = False  # whether `part` was looked for
        self.at = 0  # the place in the old log, once a read met a newer rotation

    def newer(self, record: _Rotation | None) -> bool:
        return record is not None and (self.known is None or record.seq != self.known.seq)

    def reads_on(self, record: _Rotation | None) -> bool:
        """Whether reads go on in `<name>.1` for `record`, a newer rotation done."""
        return self.newer(record) and record is not None and record.done and not self.drained

    @property
    def drained(self) -> bool:
        """A rotation was met, and all of the old log `<name>.1` could give was read."""
        return self.seen is not None and self.tried and self.part is None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def readinto(self, buffer: Any) -> int:
        if self.seen is None:
            record = _ROTATIONS.get(self.log_id)
            if not self.newer(record):
                data = os.read(self.fd, len(buffer))
                buffer[: len(data)] = data
                return len(data)
            self.seen = record
            self.at = os.lseek(self.fd, 0, os.SEEK_CUR)
        if not self.tried:
            record = _ROTATIONS.get(self.log_id)
            if not self.newer(record):  # (the rotation was undone: the log was not emptied)
                self.seen = None
                return self.readinto(buffer)
            if record is None or not record.done:
                return 0  # (being rotated: nothing to read until it is done)
            if self.seen is None or record.seq == self.seen.seq:
                self.seen = record
            self.tried = True
            self._open_regular()
        if self.part is None:
            return 0
        data = os.read(self.part, len(buffer))
        if not data:
            self._close_part()
            return 0
        buffer[: len(data)] = data
        self.at += len(data)
        return len(data)

    def _open_regular(self) -> None:
        """Go on in `<name>.1` if it holds where this was."""
        record = self.seen
        assert record is not None
        once = record.after == (self.known.seq if self.known else 0)
        if not once or not record.start <= self.at < record.end:
            return
        try:
            part = _open_regular(self.older)
        except OSError:
            return
        with part:
            if _file_id(os.fstat(part.fileno())) != record.part:
                return  # (rotated again since)
            self.part = os.dup(part.fileno())
        os.lseek(self.part, self.at - record.start, os.SEEK_SET)

    def renew(self, record: _Rotation | None) -> None:
        """The follower has dealt with the rotation `record`: read the log from its start."""
        self._close_part()
        self.known, self.seen, self.tried, self.at = record, None, False, 0
        os.lseek(self.fd, 0, os.SEEK_SET)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if offset == 0 and whence == os.SEEK_CUR:
            return self.at if self.seen is not None else os.lseek(self.fd, 0, os.SEEK_CUR)
        if self.seen is not None:
            raise io.UnsupportedOperation("seek across a rotation: renew first")
        return os.lseek(self.fd, offset, whence)

    def _close_part(self) -> None:
        if self.part is not None:
            os.close(self.part)
            self.part = None

    def close(self) -> None:
        if not self.closed:
            self._close_part()
            os.close(self.fd)
        super().close()


def _gone(n: int) -> str:
    return f"[... {n} bytes of this log were rotated away before they were read]\n"


def _missed(
    older: Path, rotation: _Rotation, at: int, skip_line: bool, mid_line: bool = False
) -> list[str]:
    """What a reader at byte `at` of a log had not read when `rotation` moved it to
    `older` (`<name>.1`): its lines from `at` on (the rest of a long line already shown
    skipped: `skip_line`), with a note, where they were, of the bytes it could not read
    (before the part's start or past its end, or a part no longer there; on a line of its
    own when the reader's last line was not ended: `mid_line`). Bounded: at most
    MISSED_BYTES of the part are read."""
    before = max(0, rotation.start - at)
    after = max(0, rotation.size - max(at, rotation.end))  # (written after the copy)
    skip_line = skip_line and at >= rotation.start  # (`.1` starts at a whole line)
    begin = max(at, rotation.start) - rotation.start
    want = rotation.end - rotation.start
    data = b""
    if begin < want:
        try:
            with _open_regular(older) as f:
                if _file_id(os.fstat(f.fileno())) != rotation.part:
                    raise OSError(errno.ESTALE, "rotated again")
                if want - begin > MISSED_BYTES:
                    before += want - begin - MISSED_BYTES
                    begin = want - MISSED_BYTES
                    skip_line = True  # (the part read now starts inside a line)
                f.seek(begin)
                data = f.read(want - begin)
        except OSError:
            before += want - begin
    lines = [("\n" if mid_line else "") + _gone(before)] if before else []
    text = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace")
    if skip_line:
        text.readline()  # (bounded: the part read is)
    part = _BoundedLines(text)
    while line := part.next(final=True):
        lines.append(line)
    if after:
        unended = lines[-1][-1:] != "\n" if lines else mid_line and not before
        lines.append(("\n" if unended else "") + _gone(after))
    return lines


async def read_lines(
    path: Path, follow: bool, tail: int | None = None
) -> AsyncGenerator[str, None]:
    """The lines of a log file (the last `tail` ones, if given), each at most MAX_LINE_CHARS
    long (cut with a note); a log that was rotated (rotate_log) starts with its older part,
    `<name>.1`, so that a process whose log was emptied by a rotation just before it ended
    still shows its last lines. With `follow`, wait for it and keep reading as it grows,
    across its rotations (what a rotation took is read from `<name>.1`). Reads only regular
    files (a log that is a link or a FIFO gives one line that says so), and gives the event
    loop a turn every YIELD_EVERY lines."""
    while follow and not path.exists():
        await asyncio.sleep(0.5)
    try:
        # Opened first: a rotation while the tail or the older part is read or sent is one
        # the follower then sees (it is newer than the one it opened with).
        log = _open_regular(path)
    except FileNotFoundError:
        return
    except OSError as e:
        yield f"[... {path.name} cannot be read as a log: {e.strerror or e}]\n"
        return
    guard = _UntilRotated(os.dup(log.fileno()), rotated_part(path))
    log.close()
    try:
        async with contextlib.aclosing(_follow(path, guard, follow, tail)) as lines:
            async for line in lines:
                yield line
    finally:
        guard.close()


async def _settled(guard: _UntilRotated) -> _Rotation | None:
    """The log's last rotation, once done (waiting up to ROTATION_WAIT for one that began)."""
    now = _ROTATIONS.get(guard.log_id)
    waited = 0.0
    while now is not None and not now.done and waited < ROTATION_WAIT:
        await asyncio.sleep(0.05)
        waited += 0.05
        now = _ROTATIONS.get(guard.log_id)
    return now


async def _follow(
    path: Path, guard: _UntilRotated, follow: bool, tail: int | None
) -> AsyncGenerator[str, None]:
    older = guard.older
    offset = 0
    if tail is not None:
        try:
            lines, offset = tail_lines(path, tail)
        except OSError:
            return  # (removed or replaced since it was opened)
        moved = guard.newer(now := await _settled(guard))
        if moved:
            # Rotated while its tail was read: which log the tail is of is not known; taken
            # as the new one's (the lines of the rotation's moment may be missed, none twice:
            # the new older part, a copy of what the tail read, is not read).
            guard.known = now
        if tail > 0 and len(lines) < tail and offset <= TAIL_WINDOW and not moved:
            # (the whole log was read and holds fewer lines: the rest from its older part)
            with contextlib.suppress(OSError):
                for line in tail_lines(older, tail - len(lines))[0]:
                    yield line
        for line in lines:
            yield line
        if not follow:
            return
    else:
        with contextlib.suppress(OSError), _open_regular(older) as raw:
            now = await _settled(guard)
            st = os.fstat(raw.fileno())
            if st.st_nlink == 0:
                raise FileNotFoundError  # (a rotation that was undone removed it: skipped)
            if guard.newer(now) and now is not None and now.done and now.part == _file_id(st):
                guard.renew(now)  # (it opened the part this rotation wrote: the log is new)
            part = _BoundedLines(io.TextIOWrapper(raw, encoding="utf-8", errors="replace"))
            count = 0
            while line := part.next(final=True):
                yield line
                count += 1
                if count % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
    with io.TextIOWrapper(io.BufferedReader(guard), encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        reader = _BoundedLines(f)
        idle = 0  # polls at the end of the file in which it did not grow
        seen = -1  # its size at the last poll
        count = 0
        ended = True  # whether the last line given ended
        carry = ""  # a line's start read before a rotation: its rest is in `<name>.1`
        while True:
            line = reader.next(final=not follow)
            if line:
                idle = 0
                line, carry = carry + line, ""
                if guard.seen is not None and line[-1] != "\n" and len(line) < MAX_LINE_CHARS:
                    carry = line  # (joined to its rest, not shown in two pieces)
                    continue
                ended = line.endswith("\n")
                yield line
                count += 1
                if count % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
                continue
            if guard.reads_on(_ROTATIONS.get(guard.log_id)):
                continue  # (reads go on in `.1` first)
            if follow:
                await asyncio.sleep(0.2)
            truncated = False
            with contextlib.suppress(OSError):
                size = os.fstat(f.fileno()).st_size
                truncated = size < f.tell()
                idle = idle + 1 if size == seen else 0
                seen = size
            now = await _settled(guard)
            if guard.newer(now) and now is not None and not now.done:
                # Still being rotated after ROTATION_WAIT: nothing of the log is read until
                # it is done (polled again), and a read without follow ends here.
                if not follow:
                    yield "[... this log is being rotated: the rest of it was not read]\n"
                    return
                continue
            if guard.reads_on(now):
                continue
            rotated = truncated or guard.newer(now)
            held = ""
            if follow and (rotated or idle >= HELD_LINE_POLLS):
                # A long line held (its writer stopped mid-line, or the file was rotated
                # under it) is shown as far as it came rather than lost.
                if held := reader.held():
                    ended = held.endswith("\n")
                    yield held
                idle = 0
            if carry and (rotated or not follow or guard.seen is None):
                # (its rest is not in `<name>.1`, or the rotation was undone)
                ended = False
                yield carry
                carry = ""
            if rotated and now is not None and guard.newer(now):
                # Rotated here (not by another process, not truncated by hand): what the
                # reads could not take from `<name>.1` is said, or read now.
                once = now.after == (guard.known.seq if guard.known else 0)
                at = guard.seek(0, os.SEEK_CUR)  # (its place in the old log)
                if once:
                    for line in _missed(older, now, at, bool(held), mid_line=not ended):
                        ended = line.endswith("\n")
                        yield line
                else:
                    yield "[... this log was rotated more than once between two reads]\n"
            if not follow:
                return
            if rotated:
                guard.renew(now)
                f.seek(0)


async def while_alive(
    lines: AsyncIterator[str], alive: Callable[[], bool], every: float = 1.0
) -> AsyncIterator[str]:
    """`lines` (a followed log) until `alive()` has been false at two checks `every` seconds
    apart (the second lets the lines written before the end come through): a follow of a
    replica or service that ended ends too, instead of holding its client forever."""
    source = lines.__aiter__()
    gone = 0
    nxt: asyncio.Future[str] | None = None
    try:
        while True:
            nxt = asyncio.ensure_future(source.__anext__())
            while True:
                done, _ = await asyncio.wait({nxt}, timeout=every)
                if done:
                    break
                gone = gone + 1 if not alive() else 0
                if gone >= 2:
                    nxt.cancel()
                    with contextlib.suppress(BaseException):
                        await nxt
                    return
            try:
                line = nxt.result()
            except StopAsyncIteration:
                return
            yield line
    finally:
        # Its client went away (the response cancelled) while a read waited: that read is
        # cancelled first; closing the source under it failed ("already running") and left
        # it polling, its file open, until its next line.
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()


def naming(service: str) -> re.Pattern[str]:
    """Text that names `service` as a word of its own (`web` and `web/3`, not `web2`)."""
    return re.compile(rf"(?<![\w.-]){re.escape(service)}(?![\w-])")


async def _whole_lines(
    path: Path, service: str, follow: bool, tail: int | None = None
) -> AsyncGenerator[str, None]:
    """read_lines' lines that name `service`, the pieces of a line not yet ended (a follower
    gives them as they come) joined to their line first: the filter sees lines whole (at
    most MAX_LINE_CHARS of each)."""
    pattern = naming(service)
    piece = ""
    async with contextlib.aclosing(read_lines(path, follow, tail)) as lines:
        async for line in lines:
            if line.endswith("\n") or len(piece) + len(line) >= MAX_LINE_CHARS:
                line, piece = piece + line, ""
                if pattern.search(line) or line.startswith(("[... ", "\n[... ")):
                    yield line  # (and the reader's own notes: what is lost, unreadable)
            else:
                piece += line
    if piece and pattern.search(piece):
        yield piece


async def lines_naming(
    path: Path, service: str, follow: bool, tail: int | None = None
) -> AsyncIterator[str]:
    """The lines of a log that name `service` (`logs --controller NAME`): the last `tail` of
    them if given, then, with `follow`, the new ones as they come."""
    if tail is None:
        async with contextlib.aclosing(_whole_lines(path, service, follow)) as lines:
            async for line in lines:
                yield line
        return
    last: collections.deque[str] = collections.deque(maxlen=tail)
    async with contextlib.aclosing(_whole_lines(path, service, False)) as lines:
        async for line in lines:
            last.append(line)
    for line in last:
        yield line
    if follow:
        async with contextlib.aclosing(_whole_lines(path, service, True, 0)) as lines:
            async for line in lines:
                yield line


FULL_DISK_TAIL = 4 * 1024 * 1024  # the most of a log's end kept when the disk is full
FULL_DISK_MIN = 64 * 1024  # on a full disk, logs past this size are rotated, under the cap too
LOW_DISK_BYTES = 1024 * 1024  # a disk with less room than this is full (for rotate_log)


def disk_full(path: Path) -> bool:
    """Whether the file system of `path` has less than LOW_DISK_BYTES left (for this user)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < LOW_DISK_BYTES


@dataclass(frozen=True)
class Rotated:
    """A log that was rotated: its size then, how many bytes of its end `<name>.1` kept, and
    whether there was no room to copy them first (the log was emptied before they were
    written back, and only a bounded tail, or nothing, could be kept)."""

    size: int
    kept: int
    full_disk: bool


LINE_SEARCH_BYTES = 64 * 1024  # how far past a cut rotate_log looks for the next line


def _line_start(f: BinaryIO, start: int, end: int) -> int:
    """`start`, or where the first line after it begins if it falls inside one (within
    LINE_SEARCH_BYTES and before `end`): `<name>.1` starts with a whole line."""
    if start <= 0:
        return 0
    f.seek(start - 1)
    ahead = f.read(min(LINE_SEARCH_BYTES, end - start) + 1)
    if ahead[:1] == b"\n":
        return start
    at = ahead.find(b"\n", 1)
    return start if at < 0 or start + at >= end else start + at


def _write_tail(
    src: Path,
    dst: Path,
    start: int,
    data: bytes | None = None,
    before_replace: Callable[[], object] | None = None,
) -> tuple[int, int, tuple[int, int]]:
    """`dst` (replaced, never followed if a link) gets `src` from byte `start` on (from the
    first line that begins there, to its end: what a writer that goes on adds while it is
    copied comes too, so that the caller's truncation right after loses as little as can be;
    at most twice what it had at first, so a writer that never stops does not hold it), or
    `data`; returns where in `src` what it holds begins (`start` with `data`), how many
    bytes it holds and its (device, inode)."""
    # Written beside it, then renamed over it: a reader of the older part keeps the one it
    # opened, whole, instead of seeing it rewritten under it.
    tmp = dst.with_name(dst.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with open(fd, "wb") as out:
            if data is not None:
                out.write(data)
            else:
                with open(src, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    start = f.seek(_line_start(f, start, size))
                    left = 2 * (size - start)
                    while left > 0 and (chunk := f.read(min(left, 1024 * 1024))):
                        out.write(chunk)
                        left -= len(chunk)
            out.flush()
            held = out.tell()
            part = _file_id(os.fstat(out.fileno()))
        if before_replace is not None:
            before_replace()  # (the rotation is published as begun before `dst` changes)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return start, held, part


def rotate_log(path: Path, cap_bytes: int, disk_full: bool = False) -> Rotated | None:
    """Keep a log under `cap_bytes` with its newest lines: past half the cap, its last half
    cap moves to `<name>.1` (replacing the older half) and the file is truncated in place, so
    the process writing it (with O_APPEND) carries on. None if it did not need to.

    On a full disk (the copy fails) the log is truncated anyway, since it is what fills the
    disk or holds the room others need: its end (at most FULL_DISK_TAIL bytes) is read first
    and written to `<name>.1` once the truncation made room, or dropped if there is none.
    With `disk_full` (the caller found no room left on the disk, whoever filled it) a log
    under the cap is rotated too, past FULL_DISK_MIN bytes, keeping half of it.
    An error that leaves the log as it was (it went away, it cannot be truncated) raises
    OSError."""
    half = cap_bytes // 2
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size <= (min(half, FULL_DISK_MIN) if disk_full else half):
        return None
    old = rotated_part(path)
    keep = min(size // 2 if disk_full else size, half)
    try:
        log_id = _file_id(os.stat(path))
        began: list[tuple[_Rotation | None, _Rotation]] = []
        try:
            start, kept, part = _write_tail(
                path, old, size - keep, before_replace=lambda: began.append(_begin_rotation(log_id))
            )
        except BaseException:
            if began:
                _undo_rotation(log_id, *began[0])
            raise
        last, record = began[0]
        emptied = os.stat(path).st_size
        try:
            os.truncate(path, 0)
        except BaseException:
            _undo_rotation(log_id, last, record)
            with contextlib.suppress(OSError):
                old.unlink()  # (a copy of what the log still holds: read twice after)
            raise
        _end_rotation(log_id, record, start, start + kept, max(emptied, start + kept), part)
        return Rotated(size, kept, full_disk=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
    # No room for the copy: what it wrote goes (that frees room too), the end of the log is
    # held in memory, the log is emptied, and the end written back if there is room now.
    with contextlib.suppress(OSError):
        old.unlink()
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        start = f.seek(_line_start(f, max(0, end - min(keep, FULL_DISK_TAIL)), end))
        tail = f.read()
        log_id = _file_id(os.fstat(f.fileno()))
    last, record = _begin_rotation(log_id)
    try:
        os.truncate(path, 0)
    except BaseException:
        _undo_rotation(log_id, last, record)
        raise
    written: tuple[int, int] | None = None
    kept = 0
    try:
        _, kept, written = _write_tail(path, old, start, tail)
    except OSError:
        with contextlib.suppress(OSError):
            old.unlink()
    finally:  # (always done: its readers wait for it)
        _end_rotation(log_id, record, start, start + kept, end, written)
    return Rotated(max(size, end), kept, full_disk=True)
