"""A stdio MCP server's process, owned by the app rather than left to the SDK's shutdown.

The SDK's stdio client ends its server only on an orderly exit of its context; a server
hung inside a call, a link torn down mid-way or an app quitting while the link's loop
stops can leave the process running. Here the app spawns the server itself (its own
process group, so helpers it started go with it), knows its pid, and ends it on every
way out: terminate the whole group, then kill it after a grace period.

``stdio_transport`` is an MCP ``Transport`` (the SDK's ``Client`` takes one) over that
process's pipes: newline-delimited JSON-RPC, as the stdio transport specifies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

GRACE_S = 2.0  # after SIGTERM, before SIGKILL
_POLL_S = 0.02


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal (or a zombie on macOS): still there
        pass
    return True


class ServerProcess:
    """The pid (and process group) of one running stdio server: ended on the link's loop
    (``end``), or killed from any thread when that loop cannot run (``kill_now``)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._process: Any = None  # anyio Process, on the link's loop

    def _signal(self, sig: int) -> bool:
        """Send ``sig`` to the server's group; False when the group is gone."""
        if self.pid is None:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _gone(self) -> bool:
        # Reading returncode lets the loop's child watcher reap the leader; a reaped leader
        # with no other members leaves an empty group.
        leader_done = self._process is None or self._process.returncode is not None
        return self.pid is None or (leader_done and not _group_alive(self.pid))

    async def end(self, grace: float = GRACE_S) -> None:
        """Terminate the group, wait up to ``grace`` for it to go, then kill it (on the
        link's loop, which reaps the leader meanwhile)."""
        import anyio

        if self.pid is None or not self._signal(signal.SIGTERM):
            return self._forget()
        with anyio.move_on_after(grace):
            while not self._gone():
                await anyio.sleep(_POLL_S)
        if not self._gone():
            self._signal(signal.SIGKILL)
            with anyio.move_on_after(grace):
                while not self._gone():
                    await anyio.sleep(_POLL_S)
        self._forget()

    def kill_now(self) -> None:
        """The last resort from another thread when the link's loop cannot run: SIGKILL."""
        if self.pid is not None:
            self._signal(signal.SIGKILL)

    def _forget(self) -> None:
        self.pid = None


def _stderr() -> Any:
    """The app's stderr for the server's log lines, or nowhere when there is none (a
    bundled app started from the Finder has no usable stderr)."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL
    return sys.stderr


@contextlib.asynccontextmanager
async def stdio_transport(command: str, args: list[str], owner: ServerProcess) -> AsyncIterator[tuple[Any, Any]]:
    """Spawn the server in a process group of its own, bridge its pipes to the SDK's
    message streams, and end the group on the way out, however the way out comes."""
    import anyio
    import mcp_types
    from anyio.streams.text import TextReceiveStream
    from mcp.client.stdio import get_default_environment
    from mcp.shared.message import SessionMessage

    process = await anyio.open_process(
        [command, *args], env=get_default_environment(), stderr=_stderr(), start_new_session=True
    )
    owner.pid, owner._process = process.pid, process
    read_in, read_out = anyio.create_memory_object_stream[Any](0)
    write_in, write_out = anyio.create_memory_object_stream[Any](0)

    async def reader() -> None:
        assert process.stdout is not None
        buffer = ""
        async with read_in:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                async for chunk in TextReceiveStream(process.stdout, errors="replace"):
                    lines = (buffer + chunk).split("\n")
                    buffer = lines.pop()
                    for line in lines:
                        if not line.strip():
                            continue
                        try:
                            item: Any = SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(line))
                        except ValueError as exc:  # a stray line: the session reports it
                            item = exc
                        await read_in.send(item)

    async def writer() -> None:
        assert process.stdin is not None
        try:
            async with write_out:
                async for message in write_out:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                    await process.stdin.send(data.encode())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_in.aclose()  # the server stopped reading: the session sees the end

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(reader)
        tasks.start_soon(writer)
        try:
            yield read_out, write_in
        finally:
            with anyio.CancelScope(shield=True):
                await owner.end()
                for stream in (read_out, write_in, process.stdin, process.stdout):
                    with contextlib.suppress(Exception):
                        await stream.aclose()  # type: ignore[union-attr]
            tasks.cancel_scope.cancel()
