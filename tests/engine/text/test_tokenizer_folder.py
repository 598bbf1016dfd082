"""Tokenizer settings read from a model folder, and refusals of broken folders."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.errors import ModelLoadError
from engine.text.tokenizer import Tokenizer


@pytest.fixture
def llama_dir(shared_data, tmp_path):
    shutil.copy(shared_data / "tokenizers/llama2/tokenizer.json", tmp_path / "tokenizer.json")
    return tmp_path


def write_config(folder, **entries):
    (folder / "tokenizer_config.json").write_text(json.dumps(entries), encoding="utf-8")


def test_special_tokens_from_config_as_added_token_dicts(shared_data):
    tok = Tokenizer.from_dir(shared_data / "tokenizers/llama2")
    assert tok.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (1, {2}, True)
    assert tok.chat_template is None


def test_add_bos_and_eos_follow_the_config(llama_dir):
    write_config(llama_dir, bos_token="<s>", eos_token="</s>", add_bos_token=False, add_eos_token=True)
    tok = Tokenizer.from_dir(llama_dir)
    body = tok.encode("Hi there", add_special_tokens=False)
    assert tok.encode("Hi there") == [*body, 2]
    assert not tok.add_bos_token


def test_special_tokens_map_fills_gaps(llama_dir):
    write_config(llama_dir, add_bos_token=True)
    (llama_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"}), encoding="utf-8"
    )
    tok = Tokenizer.from_dir(llama_dir)
    assert tok.bos_token == "<s>" and tok.eos_token_ids == {2}
    assert tok.encode("Hi")[0] == 1


def test_added_tokens_decoder_entries_missing_from_tokenizer_json(llama_dir):
    write_config(
        llama_dir, eos_token="<|im_end|>", added_tokens_decoder={"32000": {"content": "<|im_end|>", "special": True}}
    )
    tok = Tokenizer.from_dir(llama_dir)
    assert tok.token_to_id("<|im_end|>") == 32000
    assert tok.eos_token_ids == {32000}
    assert tok.encode("a<|im_end|>", add_special_tokens=False)[-1] == 32000
    assert tok.decode([tok.encode("a", add_special_tokens=False)[0], 32000], skip_special_tokens=True) == "a"


def test_chat_template_sources_in_order(llama_dir):
    write_config(llama_dir, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert Tokenizer.from_dir(llama_dir).chat_template == "D"
    (llama_dir / "chat_template.json").write_text(json.dumps({"chat_template": "J"}), encoding="utf-8")
    assert Tokenizer.from_dir(llama_dir).chat_template == "J"
    (llama_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert Tokenizer.from_dir(llama_dir).chat_template == "{{ messages[0]['content'] }}"


def test_named_templates_without_default_give_none(llama_dir):
    write_config(llama_dir, chat_template=[{"name": "rag", "template": "R"}])
    assert Tokenizer.from_dir(llama_dir).chat_template is None


def test_missing_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="No tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_files_are_refused(llama_dir):
    (llama_dir / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        Tokenizer.from_dir(llama_dir)
    (llama_dir / "tokenizer_config.json").unlink()
    (llama_dir / "tokenizer.json").write_text('{"model": {"type": "Nope"}}', encoding="utf-8")
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.from_dir(llama_dir)
    assert "\n" not in str(err.value)
