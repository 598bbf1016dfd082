"""The fallback prompt for base models that ship no chat template."""

from engine.text.chat_template import PlainTextTemplate


def test_conversation_becomes_one_running_document():
    template = PlainTextTemplate("<s>")
    messages = [
        {"role": "system", "content": "A story."},
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": ", there was a cat."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "The end"}]},
    ]
    assert template.render(messages, add_generation_prompt=True) == (
        "<s>A story.\n\nOnce upon a time, there was a cat.\n\nThe end"
    )


def test_no_bos_when_the_tokenizer_adds_none():
    assert PlainTextTemplate(None).render([{"role": "user", "content": "hi"}]) == "hi"
