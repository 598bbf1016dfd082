"""Text in and out of the model: tokenizer, streaming detokenizer, chat templates, reasoning markers."""

from engine.text.chat_template import ChatTemplate, load_template
from engine.text.detokenizer import StreamingDetokenizer
from engine.text.markers import ReasoningMarkers, ReasoningSplitter, detect_reasoning_markers
from engine.text.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ReasoningMarkers",
    "ReasoningSplitter",
    "StreamingDetokenizer",
    "Tokenizer",
    "detect_reasoning_markers",
    "load_template",
]
