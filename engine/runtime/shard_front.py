"""What the worker's process holds of a model split across machines: its text side.

The ranks hold the weights; this process keeps the tokenizer, the chat template, the end
ids and the model's description, read from the same folder, so whatever reads them from
the worker's host (the app's local server: prompts, tool formats, token texts, defaults)
reads them here as for a model loaded whole. ``SplitFront`` stands in for the worker's
ModelHost in those reads only; generation goes to the ranks (shard_worker.py). The
tokenizer is Rust code, not MLX: any thread may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.api import GenerationParams, ModelInfo, SamplingParams
from engine.runtime.token_ids import check_token_ids


class SplitFront:
    loaded = True
    tower_loaded = False
    batch = None  # every rank runs the same one request at a time

    def __init__(self, path: str) -> None:
        from engine.artifacts.config import read_config
        from engine.artifacts.hub import resolve_model_path
        from engine.runtime.assembly import _reasoning_control, _tool_format, _union, load_template
        from engine.runtime.model_info import inspect_model
        from engine.text.tokenizer import Tokenizer

        folder = resolve_model_path(path)
        config = read_config(folder)
        self.tokenizer = Tokenizer.from_dir(folder)
        self.template = load_template(self.tokenizer)
        self.eos_token_ids = _union(config.eos_token_ids, getattr(self.tokenizer, "eos_token_ids", None))
        tool_format, arguments_as_text = _tool_format(self.template)
        t = self.tokenizer
        self.info: ModelInfo = replace(
            inspect_model(path),
            chat_template=bool(getattr(t, "chat_template", None) or getattr(t, "mistral_format", None)),
            reasoning_control=_reasoning_control(self.template),
            tool_format=tool_format,
            tool_arguments_as_text=arguments_as_text,
        )
        text = config.raw.get("text_config") if isinstance(config.raw.get("text_config"), dict) else config.raw
        self.vocab = int(text.get("vocab_size") or t.vocab_size())

    def default_params(self) -> GenerationParams:
        """As ModelHost.default_params: generation_config.json's settings, where it has them."""
        defaults = self.info.generation_defaults or {}
        sp = SamplingParams()
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if defaults.get(key) is not None:
                setattr(sp, key, type(getattr(sp, key))(defaults[key]))
        if defaults.get("do_sample") is False:
            sp.temperature = 0.0
        return GenerationParams(sampling=sp)

    def check_token_ids(self, ids: Sequence[Any]) -> list[int]:
        return check_token_ids(ids, self.vocab)

    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def weights_bytes(self) -> int:
        return 0  # this process holds none: each rank's are in MemoryEvent.ranks

    def kv_bytes(self) -> int:
        return 0
