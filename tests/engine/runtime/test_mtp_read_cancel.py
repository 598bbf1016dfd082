"""A request stopped while the built-in MTP layer is being read (Qwen3.5 family).

On the tiny Qwen3.5 checkpoint with a random MTP layer (test_mtp_first_read.py), read in
chunks of a few KB:

* a cancel that lands between chunks stops the read there: the request ends "cancelled"
  with nothing generated, the layer is still apart and unread (what was read is let go:
  memory back where it was), the memory plan and the context advice are unchanged;
* the next MTP request reads the layer afresh from its first byte and drafts bit for bit
  as a model whose read was never interrupted;
* once read, the media features cache's budget follows the plan: shrunk to the room the
  layer left, the least recently used features evicted.
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from engine.api import ProgressEvent, TokenEvent
from engine.media.towers import ROOM_SHARE, features_cache_bytes
from engine.runtime import loading
from engine.runtime.host import ModelHost

from .test_memory_plan_mtp import folder_with_mtp, held_bytes
from .test_mtp_first_read import GREEDY, MTP, PROMPT, first_draft_logits, loaded, mtp_hub_weights, qwen_folder

MEDIA_GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "qwen3_5_media" / "qwen3_5"
CHUNK = 8 << 10  # the tiny layer's read takes several chunks


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_model_dir) -> Path:
    return qwen_folder(tmp_path_factory.mktemp("mtp_cancel"), tiny_model_dir)


def reads(events: list[object]) -> list[ProgressEvent]:
    return [e for e in events if isinstance(e, ProgressEvent) and e.stage == "load"]


def in_use() -> int:
    """Bytes MLX holds now. A layer let go may hold less than at load: the lazy graph's own
    constants (the + 1 of the one-centred norms) go with it."""
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def stop_after(chunks: int, events: list[object]) -> tuple[threading.Event, Callable[[object], None]]:
    """A cancel flag set once ``chunks`` chunks of the read were reported, as Stop would be."""
    cancel = threading.Event()

    def on_event(event: object) -> None:
        events.append(event)
        if len([e for e in reads(events) if e.done > 0]) >= chunks:
            cancel.set()

    return cancel, on_event


def test_a_stop_during_the_read_leaves_the_layer_apart_and_the_next_request_reads_it_afresh(folder, monkeypatch):
    monkeypatch.setattr(loading, "READ_CHUNK_BYTES", CHUNK)
    reference = loaded(folder)  # read without a stop: what drafting must give
    expected = reference.generate_ids(PROMPT, MTP)
    expected_drafts, _ = first_draft_logits(reference.model, PROMPT)
    del reference

    host = loaded(folder)
    plan, advice = host.info.plan, host.info.context_advice
    size = plan.mtp_bytes
    assert size > 4 * CHUNK
    before = in_use()
    events: list[object] = []
    cancel, on_event = stop_after(2, events)
    result = host.generate_ids(PROMPT, MTP, on_event, cancel, request_id=7)

    assert result.finish_reason == "cancelled" and result.token_ids == [] and result.text == ""
    assert result.stats.generated_tokens == 0 and result.stats.draft_tokens == 0
    assert not [e for e in events if isinstance(e, TokenEvent)]
    done = [e.done for e in reads(events)]
    assert done[0] == 0 and len(done) == 3 and 0 < done[-1] < size  # stopped between chunks
    assert not [e for e in events if isinstance(e, ProgressEvent) and e.stage != "load"]  # no prefill
    # The model as before the read: the layer apart and unread, nothing of it held.
    assert "mtp" not in host.model and host._loaded.mtp_apart is not None
    assert in_use() <= before
    assert host.info.plan == plan and not host.info.plan.mtp_loaded and host.info.context_advice == advice

    events.clear()
    drafted = host.generate_ids(PROMPT, MTP, events.append, request_id=8)
    done = [e.done for e in reads(events)]
    assert done[0] == 0 and done[-1] == size and len(done) > 4  # read afresh, from its first byte
    assert "mtp" in host.model and held_bytes(host.model.mtp) == size
    assert host.info.plan.mtp_loaded and host.info.plan.weights_bytes == plan.weights_bytes + size
    assert drafted.finish_reason == "length"
    assert drafted.token_ids == expected.token_ids == host.generate_ids(PROMPT, GREEDY).token_ids
    assert (drafted.stats.draft_tokens, drafted.stats.accepted_draft_tokens) == (
        expected.stats.draft_tokens,
        expected.stats.accepted_draft_tokens,
    )
    drafts, _ = first_draft_logits(host.model, PROMPT)
    assert mx.array_equal(drafts, expected_drafts).item()  # bit for bit


def test_a_request_stopped_before_the_read_reads_nothing(folder, monkeypatch):
    monkeypatch.setattr(loading, "READ_CHUNK_BYTES", CHUNK)
    host = loaded(folder)
    before = in_use()
    cancel = threading.Event()
    cancel.set()
    events: list[object] = []
    result = host.generate_ids(PROMPT, MTP, events.append, cancel)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert [e.done for e in reads(events)] == [0]
    assert "mtp" not in host.model and in_use() <= before
    assert host.generate_ids(PROMPT, MTP).stats.draft_tokens > 0  # and a later request drafts


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3", "glm_moe_dsa"])
def test_the_weights_set_apart_afresh_are_those_set_apart_at_load(folder, tmp_path, name):
    """What the read after a stopped one takes is the checkpoint's layer as the load prepared
    it (each family's sanitize, on a scratch model: the loaded one gains no second head)."""
    path = folder if name == "qwen3_5" else folder_with_mtp(tmp_path, name, layers=2)
    model = loading.load_model(path, memory_budget=1 << 34)
    apart = model.mtp_apart
    again = apart.unread()
    assert "mtp" not in model.model
    assert again.keys() == apart.weights.keys()
    for key, value in apart.weights.items():
        assert again[key] is not value and again[key].dtype == value.dtype
        assert mx.array_equal(again[key], value).item(), key


# ---- the media features cache follows the plan -----------------------------------------------------


def vision_folder(root: Path) -> Path:
    """The tiny Qwen3.5 vision checkpoint with a random MTP layer appended (Hub layout)."""
    from engine.models import get_family

    folder = root / "qwen3_5-vl-mtp"
    folder.mkdir()
    for f in MEDIA_GOLDEN.iterdir():
        if f.name not in ("config.json", "model.safetensors", "expected.json"):
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((MEDIA_GOLDEN / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = dict(mx.load(str(MEDIA_GOLDEN / "model.safetensors")))
    weights.update({k: v.astype(mx.bfloat16) for k, v in mtp_hub_weights(model).items()})
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


class Features:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def test_the_features_cache_shrinks_to_the_room_the_mtp_layer_leaves(tmp_path):
    folder = vision_folder(tmp_path)
    plan = loading.load_model(folder, memory_budget=1 << 34).plan
    # Room beside the weights for the recurrent state, the MTP layer twice and 64 tokens of KV:
    # once the layer is read, the room's share bounds the features cache, below what it was.
    budget = plan.weights_bytes + plan.state_bytes + 2 * plan.mtp_bytes + 64 * plan.kv_bytes_per_token
    host = ModelHost()
    host.load(str(folder), budget=budget)
    towers = host.towers
    assert towers.kinds == {"image", "video"}
    plan = host.info.plan
    first = towers.cache.stats().max_bytes
    assert first == features_cache_bytes(towers.largest_item_bytes(), plan)
    item = first // 4
    for key in ("oldest", "older", "recent", "newest"):
        towers.cache.put(key, Features(item))
    assert len(towers.cache) == 4

    host.generate_ids(PROMPT, MTP)
    after = host.info.plan
    assert after.mtp_loaded and after.weights_bytes == plan.weights_bytes + plan.mtp_bytes
    shrunk = towers.cache.stats().max_bytes
    assert (
        shrunk
        == features_cache_bytes(towers.largest_item_bytes(), after)
        == int(ROOM_SHARE * (budget - after.weights_bytes))
    )
    assert shrunk < first
    keys = ["oldest", "older", "recent", "newest"]
    fit = shrunk // item
    assert 0 < fit < len(keys)  # some, not all, still fit
    assert [key for key in keys if key in towers.cache] == keys[-fit:]  # the least recently used went
