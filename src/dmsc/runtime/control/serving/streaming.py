"""Text as it is generated: bytes drawn one by one in a thread, handed on as whole UTF-8
characters (a multi-byte character waits for its last byte; invalid bytes become U+FFFD, as the
whole text decoded at once would have them)."""

from __future__ import annotations

import codecs
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

R = TypeVar("R")


class Done(Generic[R]):
    """The last item of a stream: what the generation returned."""

    def __init__(self, result: R) -> None:
        self.result = result


def text_pieces(
    run: Callable[[Callable[[int], None]], R],
    settle: Callable[[R | None, BaseException | None], None],
    name: str = "stream",
) -> Iterator[str | Done[R]]:
    """Run ``run(on_byte)`` in a thread; yield the text as its bytes come, then ``Done``. An
    exception of ``run`` is raised here. ``settle(result, error)`` is called in the thread when
    ``run`` ends, whether or not anyone still reads the stream (a cancelled call stops reading:
    what must happen at the end, such as a task's state, goes there)."""
    drawn: queue.Queue[int | BaseException | Done[R]] = queue.Queue()

    def work() -> None:
        try:
            result = run(drawn.put)
        except BaseException as exc:  # handed to the reader, which raises it
            settle(None, exc)
            drawn.put(exc)
        else:
            settle(result, None)
            drawn.put(Done(result))

    threading.Thread(target=work, name=name, daemon=True).start()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        item = drawn.get()
        if isinstance(item, int):
            piece = decoder.decode(bytes([item]))
            if piece:
                yield piece
            continue
        if isinstance(item, BaseException):
            raise item
        piece = decoder.decode(b"", final=True)
        if piece:
            yield piece
        yield item
        return
