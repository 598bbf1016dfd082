"""MCP tools in the chat: the configured servers, their tools, and running one call.

Servers live in ``mcp.json`` in the data folder, in the layout other MCP clients use
(``{"mcpServers": {NAME: {"command": ..., "args": [...]} | {"url": ...}}}``), plus each
server's ``alwaysAllow`` list: the tools the user let run without asking.

Each server is talked to on its own thread with its own event loop (``_Link``): the SDK's
tasks and subprocess stay off the window's loop, and a server that hangs holds only its
own thread. Every request has a deadline; a server that crashes (its pipe closes) or
misses the deadline becomes a readable ``ToolError`` and is started again on next use.
A stdio server's process is the app's own (app.controllers.mcp_process): it is ended,
its whole process group with it, on a timeout, a crash, removal, disabling and quit.
No widgets here: the window supplies ``approve`` (app.ui.tool_approval).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from app.controllers.mcp_process import ServerProcess, stdio_transport
from app.ops import Op
from app.qt import QObject, Signal, emit

CONFIG_NAME = "mcp.json"
CALL_TIMEOUT_S = 30.0
START_TIMEOUT_S = 20.0

Decision = Literal["once", "always", "deny"]


class ToolError(Exception):
    """A server that could not start, crashed, timed out, or refused a call: one readable line."""


@dataclass
class McpServer:
    name: str
    command: str = ""  # a command line (stdio), or
    url: str = ""  # a Streamable HTTP endpoint
    always_allow: list[str] = field(default_factory=list)
    enabled: bool = True

    @property
    def target(self) -> str:
        return self.url or self.command


def read_config(data_dir: Path) -> tuple[dict[str, Any], str | None]:
    """``mcp.json`` as a dict, and what is wrong with it in one line (None: nothing). A file
    that cannot be used reads as empty: the problem is said, the file is left as it is."""
    path = Path(data_dir) / CONFIG_NAME
    if not path.is_file():
        return {}, None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        return {}, f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    except UnicodeDecodeError:
        return {}, f"{path} is not UTF-8 text"
    except OSError as exc:
        return {}, f"{path} cannot be read ({exc.strerror or exc})"
    if not isinstance(raw, dict):
        return {}, f'{path} must hold a JSON object with "mcpServers" in it'
    if not isinstance(raw.get("mcpServers", {}), dict):
        return {}, f'"mcpServers" in {path} must be an object of servers by name'
    return raw, None


def read_servers(data_dir: Path) -> tuple[list[McpServer], str | None]:
    """The servers ``mcp.json`` names, and what is wrong with the file or its entries."""
    raw, problem = read_config(data_dir)
    servers, bad = [], []
    for name, entry in (raw.get("mcpServers") or {}).items():
        if not isinstance(entry, dict) or not (entry.get("command") or entry.get("url")):
            bad.append(str(name))
            continue
        command = " ".join(shlex.quote(str(p)) for p in [entry.get("command", ""), *(entry.get("args") or [])] if p)
        servers.append(
            McpServer(
                str(name),
                command,
                str(entry.get("url") or ""),
                [str(t) for t in entry.get("alwaysAllow") or []],
                not entry.get("disabled", False),
            )
        )
    if bad and problem is None:
        path = Path(data_dir) / CONFIG_NAME
        problem = f'{path}: {", ".join(bad)} has neither a "command" nor a "url", so it is left out'
    return servers, problem


def load_servers(data_dir: Path) -> list[McpServer]:
    return read_servers(data_dir)[0]


def save_servers(data_dir: Path, servers: list[McpServer]) -> Path | None:
    """Write ``servers`` into ``mcp.json``, keeping what this app does not edit (other keys,
    a server's ``env``). The file before is kept as ``mcp.json.bak``; one that could not be
    read is kept under a dated name (returned), never overwritten."""
    path = Path(data_dir) / CONFIG_NAME
    raw, problem = read_config(data_dir)
    kept: Path | None = None
    if path.exists():
        if problem is not None:
            kept = path.with_name(f"mcp-unreadable-{time.strftime('%Y-%m-%d-%H%M%S')}.json")
            shutil.copy2(path, kept)
        else:
            shutil.copy2(path, path.with_name(CONFIG_NAME + ".bak"))
    before = raw.get("mcpServers") or {}
    entries: dict[str, Any] = {}
    for s in servers:
        entry = (
            {k: v for k, v in before.get(s.name, {}).items() if k not in _EDITED}
            if isinstance(before.get(s.name), dict)
            else {}
        )
        if s.url:
            entry["url"] = s.url
        else:
            parts = shlex.split(s.command)
            entry.update(command=parts[0] if parts else "", args=parts[1:])
        if s.always_allow:
            entry["alwaysAllow"] = sorted(s.always_allow)
        if not s.enabled:
            entry["disabled"] = True
        entries[s.name] = entry
    partial = path.with_name(CONFIG_NAME + ".part")
    partial.write_text(json.dumps({**raw, "mcpServers": entries}, indent=2), encoding="utf-8")
    partial.replace(path)  # never a half-written mcp.json
    return kept


# The keys of a server entry this app writes; any other (env, cwd, headers...) is kept.
_EDITED = ("command", "args", "url", "alwaysAllow", "disabled")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class _Link:
    """One server's connection, on a thread of its own."""

    def __init__(self, server: McpServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"mcp-{server.name}", daemon=True)
        self._thread.start()
        self._client: Any = None
        self._stop: asyncio.Event | None = None
        self._task: Any = None
        self.process = ServerProcess()  # a stdio server's pid while it runs

    def _run(self) -> None:
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _hold(self, ready: asyncio.Future[Any]) -> None:
        """Open the client and keep it open (the SDK's scopes must close in the task that opened them)."""
        from mcp import Client

        if self.server.url:
            target: Any = self.server.url
        else:
            parts = shlex.split(self.server.command)
            if not parts:
                raise ToolError(f"The MCP server '{self.server.name}' has no command.")
            target = stdio_transport(parts[0], parts[1:], self.process)
        self._stop = asyncio.Event()
        try:
            async with Client(target) as client:
                self._client = client
                ready.set_result(client)
                await self._stop.wait()
        except BaseException as exc:  # the server died or never started
            if not ready.done():
                ready.set_exception(exc)
        finally:
            self._client = None

    async def _connected(self) -> Any:
        if self._client is not None and self._task is not None and not self._task.done():
            return self._client
        ready: asyncio.Future[Any] = self.loop.create_future()
        self._task = self.loop.create_task(self._hold(ready))
        try:
            return await asyncio.wait_for(ready, START_TIMEOUT_S)
        except asyncio.TimeoutError:
            await self.process.end()
            self._task.cancel()
            raise ToolError(
                f"The MCP server '{self.server.name}' did not start within {START_TIMEOUT_S:.0f} s."
            ) from None

    def _reset(self) -> None:
        """Let the connection close (the transport ends the server's process on the way out)."""
        if self._stop is not None:
            self._stop.set()
        self._client = None

    async def _drop(self) -> None:
        """A hung or broken server: end its process now (the connection then sees its pipes
        close), so nothing of it outlives the failure; the next use starts it afresh."""
        await self.process.end()
        self._reset()

    async def _shutdown(self) -> None:
        await self._drop()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(self._task, 5.0)
            except BaseException:  # noqa: BLE001 - closing whatever state it is in
                pass
        self._task = None

    async def run(self, what: str, call: Callable[[Any], Awaitable[Any]], timeout: float) -> Any:
        name = self.server.name
        try:
            client = await self._connected()
            return await asyncio.wait_for(call(client), timeout)
        except ToolError:
            await self._drop()
            raise
        except asyncio.TimeoutError:
            await self._drop()  # a hung server is started afresh next time
            raise ToolError(f"The MCP server '{name}' did not answer {what} within {timeout:.0f} s.") from None
        except Exception as exc:
            await self._drop()
            if "closed" in str(exc).lower() or isinstance(exc, (OSError, EOFError)):
                raise ToolError(f"The MCP server '{name}' stopped ({_one_line(exc)}) during {what}.") from None
            raise ToolError(f"The MCP server '{name}' failed {what}: {_one_line(exc)}") from None

    def close(self) -> None:
        """End the connection and the thread (waits a few seconds at most)."""
        try:
            self.submit(self._shutdown()).result(timeout=10.0)
        except Exception:  # noqa: BLE001 - a wedged loop: kill the server from here
            self.process.kill_now()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


@dataclass
class ToolCall:
    """A call the model wrote, as the chat handles it."""

    id: str
    name: str  # the tool's name as offered to the model
    arguments: str  # JSON text


class ToolsController(QObject):
    status = Signal(str)
    failed = Signal(str)
    servers_changed = Signal()

    def __init__(self, data_dir: Path, parent: QObject | None = None, *, timeout_s: float = CALL_TIMEOUT_S):
        super().__init__(parent)
        self.data_dir = Path(data_dir)
        self.timeout_s = timeout_s
        # What is wrong with mcp.json, if anything: the window and the Tools dialog say it.
        self.servers, self.config_problem = read_servers(self.data_dir)
        self._links: dict[str, _Link] = {}
        self._owners: dict[str, str] = {}  # tool name -> server name (from the last listing)
        # How the window asks the user about a call: (server, tool, arguments) -> decision.
        self.approve: Callable[[str, str, dict[str, Any]], Awaitable[Decision]] | None = None

    # ---- the list of servers -------------------------------------------------------------

    def set_servers(self, servers: list[McpServer]) -> None:
        keep = {s.name: s for s in servers}
        for name in list(self._links):
            old = self._links[name].server
            new = keep.get(name)
            if new is None or not new.enabled or (new.command, new.url) != (old.command, old.url):
                self._links.pop(name).close()
        self.servers = list(servers)
        try:
            kept = save_servers(self.data_dir, self.servers)
        except OSError as exc:
            emit(self.failed, f"Could not save the MCP servers to {CONFIG_NAME}: {exc.strerror or exc}.")
            return
        if kept is not None:
            emit(
                self.status,
                f"{CONFIG_NAME} could not be read, so it is kept as {kept.name}; a new one lists these servers.",
            )
        self.config_problem = None
        emit(self.servers_changed)

    def add_server(self, name: str, target: str) -> McpServer:
        name, target = name.strip(), target.strip()
        if not name or not target:
            raise ValueError("An MCP server needs a name and a command or URL.")
        if any(s.name == name for s in self.servers):
            raise ValueError(f"There is already an MCP server called '{name}'.")
        is_url = target.startswith(("http://", "https://"))
        server = McpServer(name, "" if is_url else target, target if is_url else "")
        self.set_servers([*self.servers, server])
        return server

    def remove_server(self, name: str) -> None:
        self.set_servers([s for s in self.servers if s.name != name])

    @property
    def enabled(self) -> list[McpServer]:
        return [s for s in self.servers if s.enabled and s.target]

    def _link(self, server: McpServer) -> _Link:
        link = self._links.get(server.name)
        if link is None:
            link = self._links[server.name] = _Link(server)
        link.server = server
        return link

    async def _on(self, server: McpServer, what: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        link = self._link(server)
        return await Op.of_future(link.submit(link.run(what, call, self.timeout_s)))  # on the link's own loop

    # ---- tools offered to the model ------------------------------------------------------

    async def offered(self) -> list[dict[str, Any]]:
        """Every enabled server's tools as OpenAI function entries (what the chat template
        takes). A server that cannot list them is reported on ``status`` and left out."""
        tools: list[dict[str, Any]] = []
        self._owners = {}
        for server in self.enabled:
            try:
                listing = await self._on(server, "the list of its tools", lambda c: c.list_tools())
            except ToolError as exc:
                emit(self.status, f"{exc} Its tools are left out of this reply.")
                continue
            for tool in listing.tools:
                if tool.name in self._owners:  # two servers, one name: the first keeps it
                    continue
                self._owners[tool.name] = server.name
                schema = getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None)
                tools.append(
                    {
                        "type": "function",
                        "function": {
                            "name": tool.name,
                            "description": tool.description or "",
                            "parameters": schema or {"type": "object", "properties": {}},
                        },
                    }
                )
        return tools

    def server_of(self, tool: str) -> McpServer | None:
        name = self._owners.get(tool)
        return next((s for s in self.servers if s.name == name), None)

    # ---- one call --------------------------------------------------------------------------

    async def decide(self, call: ToolCall) -> Decision:
        """ "once"/"always" to run it, "deny" not to: the user's choice unless they always allow it."""
        server = self.server_of(call.name)
        if server is None:
            return "deny"
        if call.name in server.always_allow:
            return "once"
        if self.approve is None:
            return "deny"
        decision = await self.approve(server.name, call.name, _arguments(call))
        if decision == "always":
            server.always_allow.append(call.name)
            save_servers(self.data_dir, self.servers)
        return decision

    async def call(self, call: ToolCall) -> str:
        """Run an approved call; the result as text for the model. ToolError when the server
        crashes, hangs past the deadline or is unknown."""
        server = self.server_of(call.name)
        if server is None:
            raise ToolError(f"No MCP server offers a tool called '{call.name}'.")
        args = _arguments(call)
        result = await self._on(server, f"the call to {call.name}", lambda c: c.call_tool(call.name, args))
        text = "\n".join(
            getattr(part, "text", "") or f"[{getattr(part, 'type', 'content')}]" for part in result.content
        )
        is_error = bool(getattr(result, "is_error", False) or getattr(result, "isError", False))
        return f"Error: {text}" if is_error else text

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


def _arguments(call: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        return {}
    return args if isinstance(args, dict) else {}
