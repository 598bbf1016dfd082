"""inspect: family, size, quantization and the memory plan, without loading weights."""

from __future__ import annotations

from tiny_checkpoints import WIDE_LLAMA

from engine.runtime.model_info import format_inspect, inspect_model


def test_inspect_quantized_folder(checkpoint):
    ckpt = checkpoint(config=WIDE_LLAMA, bits=4, group_size=32, generation_config={"temperature": 0.6})
    info = inspect_model(ckpt.path, memory_budget=1_000_000)
    assert (info.family, info.quantization, info.context_length) == ("llama", "4-bit g32", 512)
    h, i, v = 128, 256, 256
    assert info.parameters == 2 * v * h + h + 2 * (2 * h * h + 2 * h * 64 + 3 * h * i + 2 * h)
    assert info.generation_defaults == {"temperature": 0.6}
    assert info.plan.kv_bytes_per_token == 512 and info.plan.budget_bytes == 1_000_000
    text = format_inspect(info)
    assert "family        llama" in text and "quantization  4-bit g32" in text
    assert info.plan.max_context == (1_000_000 - info.plan.weights_bytes) // 512 > 512
    assert "max context   512 tokens (the model's full context)" in text
    tight = inspect_model(ckpt.path, memory_budget=info.plan.weights_bytes + 100 * 512 + 10)
    assert "max context   100 tokens\n" in format_inspect(tight) + "\n"


def test_inspect_says_when_it_does_not_fit(checkpoint):
    info = inspect_model(checkpoint().path, memory_budget=1000)
    assert "fits          no: the weights alone exceed the budget" in format_inspect(info)


def test_inspect_gguf(shared_data):
    info = inspect_model(shared_data / "tiny_llm" / "stories260K.gguf")
    assert (info.family, info.quantization, info.parameters) == ("llama", "F32", 292_800)
    assert "max context   2,048 tokens (the model's full context)" in format_inspect(info)
