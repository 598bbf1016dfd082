"""The app fixtures (a window over the real engine, a qasync loop) for the fault tests."""

from tests.app.conftest import aloop, make_window, run_async, tiny_model  # noqa: F401
