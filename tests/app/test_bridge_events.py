"""EngineBridge.generate's per-request events: each consumer hears its own request only.

The real worker on the tiny model; two chats decode together in the batch, so their
tokens interleave on the bridge's global signal and must not cross to each other.
"""

from __future__ import annotations

import asyncio

from app.bridge import EngineBridge, RequestEvents
from engine import api


def _params(n: int) -> api.GenerationParams:
    return api.GenerationParams(max_tokens=n, ignore_eos=True)


def test_two_generations_at_once_each_hear_only_their_own_tokens(qtbot, run_async, tiny_model):
    bridge = EngineBridge()
    heard: dict[str, list[str]] = {"a": [], "b": []}
    on_signal: list[int] = []
    bridge.token.connect(lambda rid, _text, _channel: on_signal.append(rid))
    try:

        async def go() -> tuple[api.GenerationResult, api.GenerationResult]:
            await bridge.load_model(str(tiny_model))
            ask = [{"role": "user", "content": "hello there"}]
            a = bridge.generate("a", ask, _params(24), events=RequestEvents(token=lambda t, _c: heard["a"].append(t)))
            b = bridge.generate("b", ask, _params(16), events=RequestEvents(token=lambda t, _c: heard["b"].append(t)))
            return await asyncio.gather(a, b)

        result_a, result_b = run_async(go())
    finally:
        bridge.shutdown()
    switches = sum(1 for x, y in zip(on_signal, on_signal[1:], strict=False) if x != y)
    assert len(set(on_signal)) == 2 and switches > 1  # interleaved on the global signal (the batch)
    assert "".join(heard["a"]) == result_a.text and result_a.stats.generated_tokens == 24
    assert "".join(heard["b"]) == result_b.text and result_b.stats.generated_tokens == 16


def test_a_cancelled_call_hears_nothing_after_it_returned(qtbot, run_async, tiny_model):
    bridge = EngineBridge()
    heard: list[str] = []
    try:

        async def go() -> int:
            await bridge.load_model(str(tiny_model))
            first = asyncio.Event()

            def token(text: str, _channel: str) -> None:
                heard.append(text)
                first.set()

            call = asyncio.ensure_future(
                bridge.generate(
                    "c", [{"role": "user", "content": "go on"}], _params(100_000), events=RequestEvents(token=token)
                )
            )
            await first.wait()
            call.cancel()  # the awaiting side gives up; the engine is told to stop
            try:
                await call
            except asyncio.CancelledError:
                pass
            stopped_at = len(heard)
            # The engine may still send the tokens it made before it read the cancel.
            await bridge.generate("d", [{"role": "user", "content": "next"}], _params(8))
            return stopped_at

        stopped_at = run_async(go())
    finally:
        bridge.shutdown()
    assert stopped_at >= 1 and len(heard) == stopped_at


def test_a_load_s_progress_goes_to_its_caller(qtbot, run_async, tiny_model):
    bridge = EngineBridge()
    heard: list[tuple[str, float, float]] = []
    try:

        async def go() -> api.ModelInfo:
            events = RequestEvents(progress=lambda stage, done, total, _message: heard.append((stage, done, total)))
            return await bridge.load_model(str(tiny_model), events=events)

        info = run_async(go())
    finally:
        bridge.shutdown()
    assert info.name
    assert heard and {stage for stage, _, _ in heard} == {"load"}
    assert heard[-1][1] == heard[-1][2] > 0  # it ends with the whole of it read
