"""Media content parts: pairing parts with attachments, placeholders, per-token keys."""

from __future__ import annotations

import pytest

from engine.api import MediaInput
from engine.decode.prefill import PromptInputs
from engine.errors import MediaError
from engine.media.parts import media_kinds, split_media, user_message
from engine.media.prompt import PreparedMedia, expand_placeholders, locate_media


def test_parts_take_attachments_in_order_and_inline_sources_win():
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image", "image": "/tmp/b.png"},
                {"type": "audio"},
            ],
        },
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "file:///tmp/c.png"}}, {"type": "image"}],
        },
    ]
    attached = [MediaInput("image", "a.png"), MediaInput("audio", b"RIFF"), MediaInput("image", "d.png")]
    out, items = split_media(messages, attached)
    assert [(m.kind, m.source) for m in items] == [
        ("image", "a.png"),
        ("image", "/tmp/b.png"),
        ("audio", b"RIFF"),
        ("image", "/tmp/c.png"),
        ("image", "d.png"),
    ]
    # Templates see plain typed parts; text and string contents pass through untouched.
    assert out[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "audio"},
    ]
    assert out[0] == messages[0] and out[3]["content"] == [{"type": "image"}, {"type": "image"}]
    assert media_kinds(messages) == {"image", "audio"}


@pytest.mark.parametrize(
    "messages,attached,needle",
    [
        ([{"role": "user", "content": [{"type": "image"}]}], [], "more image parts"),
        ([{"role": "user", "content": "hi"}], [MediaInput("image", "a.png")], 'no {"type": "image"} part'),
        ([{"role": "user", "content": [{"type": "image", "url": "https://x.org/a.png"}]}], [], "web address"),
    ],
)
def test_mismatched_parts_are_refused_readably(messages, attached, needle):
    with pytest.raises(MediaError) as info:
        split_media(messages, attached)
    assert needle in str(info.value)


def test_cli_message_puts_media_first_then_text():
    media = [MediaInput("image", "a.png"), MediaInput("audio", "b.wav"), MediaInput("image", "c.png")]
    assert user_message("what?", media) == {
        "role": "user",
        "content": [{"type": "image"}, {"type": "audio"}, {"type": "image"}, {"type": "text", "text": "what?"}],
    }
    assert user_message("hi", []) == {"role": "user", "content": "hi"}


def _item(key: str, n: int) -> PreparedMedia:
    return PreparedMedia(kind="image", key=key, n_tokens=n, text="<B>" + "<S>" * n + "<E>", data=None)


def test_placeholders_expand_in_order_and_keys_tell_images_apart():
    items = [_item("photo-1", 2), _item("photo-2", 3)]
    text = expand_placeholders("x<I>y<I>z", items, {"image": "<I>"})
    assert text == "x<B><S><S><E>y<B><S><S><S><E>z"
    ids = [5, 7, 9, 9, 8, 6, 7, 9, 9, 9, 8, 4]
    prompt = locate_media(ids, items, {"image": 9})
    assert [(s.start, s.end) for s in prompt.spans] == [(2, 4), (7, 10)]
    assert prompt.keys[2] == ("photo-1", 0) and prompt.keys[9] == ("photo-2", 2) and prompt.keys[0] == 5
    other = locate_media(ids, [_item("photo-9", 2), items[1]], {"image": 9})
    assert other.ids == prompt.ids and other.keys != prompt.keys
    with pytest.raises(MediaError, match="no '<I>'"):
        expand_placeholders("only one <I>", items, {"image": "<I>"})
    with pytest.raises(MediaError, match="placeholder token with no image"):
        locate_media(ids + [9], items, {"image": 9})


def test_prefill_chunks_never_split_a_bidirectional_block():
    inputs = PromptInputs(blocks=[(3, 9)])
    assert inputs.chunk_end(0, 5) == 3  # back to the block's start
    assert inputs.chunk_end(3, 5) == 9  # the block begins the chunk: take all of it
    assert inputs.chunk_end(9, 12) == 12
    assert inputs.kwargs(3, 9)["bidirectional"] == [(0, 6)]
    assert "bidirectional" not in inputs.kwargs(0, 3)
