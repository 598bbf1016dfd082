"""Entry point: ``mlx-desk [--model PATH] [--data-dir DIR]`` (also ``python -m app.main``).

The window is shown first; the engine (and with it mlx) is imported and the
model loaded afterwards, on the event loop, so the app opens at once.

Two modes run without a person, for packaging checks:
  ``--smoke-test PROMPT``  load ``--model``, send PROMPT through the window, print the
                           reply, ``smoke-test: ok <N> tokens`` and a JSON line of
                           timings (window shown, model loaded); exit 1 with one
                           ``smoke-test: failed: <reason>`` line on stderr otherwise.
  ``--quit-after-show``    print ``window shown after X.XXX s`` (from process start)
                           once the window has painted, then quit.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import tempfile
from pathlib import Path

from app import __version__ as APP_VERSION  # noqa: N812
from app.startup import seconds_since_start  # first: starts the clock where /proc cannot

SMOKE_MAX_TOKENS = 48


def default_data_dir() -> Path:
    """The platform's app-data folder (Qt's AppDataLocation when available)."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "MLX Desk"
    if os.name == "nt":
        return Path(os.environ.get("APPDATA", Path.home())) / "MLX Desk"
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "mlx-desk"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlx-desk", description="Chat with local models on MLX.")
    p.add_argument(
        "files",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="files to open: a model folder or .gguf loads, images and audio are attached",
    )
    p.add_argument("--model", help="model folder, .gguf file or Hugging Face repo id to load")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where history.sqlite3 and presets live (default: the app-data folder)",
    )
    p.add_argument(
        "--smoke-test",
        metavar="PROMPT",
        default=None,
        help="load --model, send PROMPT through the window, print the reply, quit "
        "(history goes to a temporary folder unless --data-dir is given)",
    )
    p.add_argument(
        "--smoke-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up a --smoke-test after this long (default 300)",
    )
    p.add_argument("--quit-after-show", action="store_true", help="print how long the window took to appear, then quit")
    p.add_argument("--version", action="version", version=f"MLX Desk {APP_VERSION}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke_test is not None and not args.model:
        print("smoke-test: failed: --smoke-test needs --model", file=sys.stderr)
        return 1
    from app.display_check import display_problem

    problem = display_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    import qasync

    from app.bridge import EngineBridge, EngineUnavailable
    from app.history_recovery import open_history
    from app.qt import QApplication, QIcon, quiet_platform_noise
    from app.resources import resource_path
    from app.single_instance import SingleInstance, bring_forward
    from app.tasks import spawn
    from app.ui.file_open import install_file_open, open_paths
    from app.ui.history_dialog import ask_with_dialog
    from app.ui.main_window import MainWindow, first_paint
    from app.ui.theme import apply_theme

    quiet_platform_noise()
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("MLX Desk")
    app.setOrganizationName("MLX Desk")
    app.setApplicationVersion(APP_VERSION)
    icon = resource_path("icons/mlx-desk.svg")
    if icon.exists():
        app.setWindowIcon(QIcon(str(icon)))
    dark = apply_theme(app)

    scratch = None
    if args.data_dir is None and args.smoke_test is not None:
        scratch = tempfile.TemporaryDirectory(prefix="mlx-desk-smoke-")
    data_dir = args.data_dir or (Path(scratch.name) if scratch else default_data_dir())
    # One app per data folder: a second one hands its files over before touching the history.
    instance = SingleInstance(data_dir)
    if not instance.claim([str(f) for f in args.files], args.model):
        print(f"mlx-desk: MLX Desk is already running on {data_dir}; the files went to its window.", file=sys.stderr)
        return 0
    # A damaged or read-only history asks what to do (fresh, salvage, another folder).
    notes: list[str] = []
    store = open_history(data_dir, _print_and_quit if args.smoke_test is not None else ask_with_dialog, notes)
    if store is None:
        return 2

    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    bridge = EngineBridge()
    window = MainWindow(store, bridge, dark=dark)
    install_file_open(window)  # files dropped on the Dock icon or opened with the app
    instance.files_received.connect(lambda files, model: bring_forward(window, files, model))
    shown = first_paint(window)
    window.show()
    # Follow the system when it switches between light and dark while the app runs.
    app.styleHints().colorSchemeChanged.connect(lambda _scheme: apply_theme(app))
    window.composer.edit.setFocus()
    for note in notes:
        window.notify(note)
    exit_code = [0]

    async def start_engine() -> None:
        await shown  # the heavy import and the load wait for the first painted window
        window_shown_s = seconds_since_start()
        if args.quit_after_show:
            print(f"window shown after {seconds_since_start():.3f} s", flush=True)
            app.quit()
            return
        try:
            bridge.start()
        except EngineUnavailable as exc:
            window.show_error(str(exc))
            if args.smoke_test is not None:
                fail(str(exc))
            return
        # What is alive now (the modules, Qt's and the engine's) lives as long as the app: out
        # of the collector's full passes, which otherwise walk all of it on the GUI thread
        # (60-80 ms each, the longest stalls of a long session).
        gc.freeze()
        if args.smoke_test is not None:
            try:
                await asyncio.wait_for(
                    smoke_test(window, args.model, args.smoke_test, window_shown_s), args.smoke_timeout
                )
            except asyncio.TimeoutError:
                fail(f"no reply within {args.smoke_timeout:.0f} s")
            except SmokeFailure as exc:
                fail(str(exc))
            else:
                app.quit()
        else:
            await open_paths(window, args.files, model=args.model)

    def fail(reason: str) -> None:
        print(f"smoke-test: failed: {' '.join(reason.split())}", file=sys.stderr, flush=True)
        exit_code[0] = 1
        app.quit()

    app_closing = asyncio.Event()
    app.aboutToQuit.connect(app_closing.set)
    with loop:
        spawn(start_engine())
        loop.run_until_complete(app_closing.wait())
    bridge.shutdown(5.0)
    instance.close()
    store.close()
    if scratch is not None:
        scratch.cleanup()
    return exit_code[0]


def _print_and_quit(problem) -> tuple[str, None]:
    """Without a person (smoke tests) a history problem is one line, then out."""
    print(f"mlx-desk: {' '.join(problem.message.split())}", file=sys.stderr)
    return "quit", None


class SmokeFailure(Exception):
    """The smoke test's one readable reason."""


async def smoke_test(window, model: str, prompt: str, window_shown_s: float) -> None:
    """Load, then send ``prompt`` the way a person would: type it, press Send. Prints the
    reply, a ``smoke-test: ok`` line, and last a JSON line of timings for scripts."""
    import json

    from app.qt import Qt

    if not await window.load_model(model):
        raise SmokeFailure(window.error_banner.text() or f"could not load {model}")
    model_loaded_s = seconds_since_start()
    chunks = [0]
    window.bridge.token.connect(lambda *_: chunks.__setitem__(0, chunks[0] + 1))
    window.new_chat()
    conv = window.chat.conversation_id
    # Greedy and short: the reply is reproducible and the check quick.
    window.store.update_conversation(conv, settings={"temperature": 0.0, "max_tokens": SMOKE_MAX_TOKENS, "seed": 0})
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def finished(_message_id: int, result) -> None:
        if not done.done():
            done.set_result(result)

    def failed(reason: str) -> None:
        if not done.done():
            done.set_exception(SmokeFailure(reason))

    window.chat.reply_finished.connect(finished, Qt.ConnectionType.QueuedConnection)
    window.chat.failed.connect(failed, Qt.ConnectionType.QueuedConnection)
    window.composer.edit.setPlainText(prompt)
    window.composer.send_button.click()
    result = await done
    if result is None:
        raise SmokeFailure("the reply ended without a result")
    if result.finish_reason not in ("stop", "length"):
        raise SmokeFailure(result.error or f"the reply ended with {result.finish_reason}")
    sys.stdout.write(result.text + "\n")
    sys.stdout.write(f"smoke-test: ok {result.stats.generated_tokens} tokens\n")
    sys.stdout.write(
        json.dumps(
            {
                "window_shown_s": round(window_shown_s, 3),
                "model_loaded_s": round(model_loaded_s, 3),
                "reply": result.text,
                "streamed_chunks": chunks[0],
                "finish_reason": result.finish_reason,
                "generated_tokens": result.stats.generated_tokens,
            }
        )
        + "\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
