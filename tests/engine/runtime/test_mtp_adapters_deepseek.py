"""Adapters that name DeepSeek V3's and GLM-5's MTP layer as the checkpoints store it.

Those checkpoints store the MTP layer as one more decoder layer, ``model.layers.N.*`` with
N = num_hidden_layers, so an adapter trained on their layout names it that way; here it
loads (or waits unread until the first MTP request) as ``mtp.*``. On the tiny DeepSeek V3
(latent attention with a query LoRA) and GLM-5 (with a DSA indexer) goldens, float32 on
disk, with a random MTP layer appended as the checkpoints store it:

* such an adapter mounted before the read covers the layer once read, its drafts equal bit
  for bit to the layer read first and the adapter mounted after, and to the same weights
  named ``mtp.*``; the adapter moves the drafts, its targets in the ordinary layers stay
  where they are, and unmounting gives back the plain drafts (LoRA and DoRA);
* on a checkpoint without the layer (mlx-lm's conversions drop it) such an adapter is
  refused in one line and the model is left as it was; so is an adapter that names one
  module in both spellings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engine.errors import AdapterError
from engine.models import lora
from engine.models.lora import adapter_set
from engine.runtime import loading
from engine.runtime.host import ModelHost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_goldens import GOLDEN  # noqa: E402
from spec_models import first_draft_logits  # noqa: E402

from .test_memory_plan_mtp import folder_with_mtp, with_tokenizer  # noqa: E402
from .test_mtp_first_read import GREEDY, MTP, adapted_layers, loaded, peft_adapter, read_then_mount  # noqa: E402

NAMES = ["deepseek_v3", "glm_moe_dsa"]
# The MTP layer's own projection, its attention (the two input projections stacked into one
# matmul when no adapter acts on them), its shared expert and, for GLM-5, its indexer; and
# one projection of an ordinary layer, which must stay where it is.
IN_MTP = [
    "eh_proj",
    "layers.0.self_attn.q_a_proj",
    "layers.0.self_attn.kv_a_proj_with_mqa",
    "layers.0.self_attn.o_proj",
    "layers.0.mlp.shared_experts.down_proj",
]
ORDINARY = "model.layers.1.self_attn.q_b_proj"


def n_layers(name: str) -> int:
    return json.loads((GOLDEN / name / "config.json").read_text())["num_hidden_layers"]


def in_mtp(name: str) -> list[str]:
    return IN_MTP + (["layers.0.self_attn.indexer.wq_b"] if name == "glm_moe_dsa" else [])


def prompt(name: str) -> list[int]:
    return json.loads((GOLDEN / name / "expected.json").read_text())["prompt_ids"][:20]


def renamed(adapter: Path, *pairs: tuple[str, str]) -> Path:
    """A copy of a PEFT adapter folder with each ``old`` in its tensor names replaced by ``new``."""
    out = adapter.with_name(adapter.name + "-renamed")
    out.mkdir()
    (out / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    weights = mx.load(str(adapter / "adapter_model.safetensors"))
    for old, new in pairs:
        weights = {k.replace(old, new): v for k, v in weights.items()}
    mx.save_safetensors(str(out / "adapter_model.safetensors"), weights)
    return out


def as_stored(adapter: Path, name: str) -> Path:
    """The same adapter with its MTP targets named as the checkpoint stores the layer
    (``mtp.layers.0.x`` and ``mtp.x`` -> ``model.layers.N.x``)."""
    stored = f"model.layers.{n_layers(name)}."
    return renamed(adapter, ("mtp.layers.0.", stored), ("mtp.", stored))


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory, tiny_model_dir):
    """(name, model folder with an MTP layer, the model with it loaded to size adapters by)."""
    root = tmp_path_factory.mktemp(request.param)
    folder = with_tokenizer(folder_with_mtp(root, request.param, layers=1, dtype=mx.float32), tiny_model_dir)
    shapes = loading.load_model(folder, memory_budget=1 << 34, mtp=True).model
    return request.param, folder, shapes


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_an_adapter_naming_the_stored_layer_covers_the_mtp_layer(family, tmp_path, dora):
    name, folder, shapes = family
    ids = prompt(name)
    by_mtp = peft_adapter(tmp_path, ["mtp." + p for p in in_mtp(name)] + [ORDINARY], shapes, dora=dora)
    stored = as_stored(by_mtp, name)
    want_mtp, want_body = set(in_mtp(name)), {ORDINARY}

    # The layer read first, then the adapter mounted: the reference.
    after, plain_drafts, reference = read_then_mount(folder, stored, "tuned", ids)
    assert adapted_layers(after.model.mtp) == want_mtp
    assert adapted_layers(after.model) - {"mtp." + p for p in want_mtp} == want_body
    assert not mx.allclose(reference, plain_drafts, atol=1e-2).item()  # the adapter moves the drafts

    # The adapter mounted first, then the layer read by the first MTP request.
    before = loaded(folder)
    assert before.mount_adapter(str(stored), "tuned").targets == len(want_mtp) + 1
    assert "mtp" not in before.model and len(adapter_set(before.model).waiting["tuned"]) == len(want_mtp)
    assert adapted_layers(before.model) == want_body  # the ordinary layer takes it at once
    before.set_active_adapters({"tuned": 1.0})
    drafted = before.generate_ids(ids, MTP)
    assert drafted.token_ids == before.generate_ids(ids, GREEDY).token_ids and drafted.stats.draft_tokens > 0
    assert adapted_layers(before.model.mtp) == want_mtp and adapter_set(before.model).waiting == {}
    drafts, _ = first_draft_logits(before.model, ids)
    assert mx.array_equal(drafts, reference).item()  # bit for bit, as if loaded with the model

    # The same weights named as our modules are: the same drafts.
    named = loaded(folder)
    named.mount_adapter(str(by_mtp), "tuned")
    named.set_active_adapters({"tuned": 1.0})
    named.generate_ids(ids, MTP)
    assert mx.array_equal(first_draft_logits(named.model, ids)[0], reference).item()

    before.unmount_adapter("tuned")
    assert adapted_layers(before.model) == set()
    unmounted, _ = first_draft_logits(before.model, ids)
    assert mx.array_equal(unmounted, plain_drafts).item()


@pytest.mark.parametrize("name", NAMES)
def test_without_the_layer_an_adapter_naming_it_is_refused_in_one_line(name, tmp_path, tiny_model_dir):
    folder = with_tokenizer(folder_with_mtp(tmp_path, name, layers=0, dtype=mx.float32), tiny_model_dir)
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1  # as mlx-lm's conversions leave it: the layer is gone
    (folder / "config.json").write_text(json.dumps(config))
    host = ModelHost()
    host.load(str(folder), budget=1 << 34)
    shapes = host.model  # the MTP layer's q_a_proj has the ordinary layers' shape
    n = n_layers(name)
    adapter = peft_adapter(tmp_path, ["model.layers.1.self_attn.q_a_proj"], shapes)
    stored = renamed(adapter, ("model.layers.1.", f"model.layers.{n}."))
    with pytest.raises(AdapterError) as err:
        host.mount_adapter(str(stored), "nowhere")
    text = str(err.value)
    assert "\n" not in text
    assert f"model.layers.{n}.self_attn.q_a_proj, in the built-in MTP layer, which this model's weights" in text
    assert adapted_layers(host.model) == set() and "mtp" not in host.model and host.adapters() == []


def test_one_module_named_in_both_spellings_is_refused(family, tmp_path):
    name, _, shapes = family
    adapter = peft_adapter(tmp_path, ["mtp.eh_proj"], shapes)
    both = renamed(adapter, ("mtp.eh_proj", f"model.layers.{n_layers(name)}.eh_proj"))
    weights = {
        **mx.load(str(adapter / "adapter_model.safetensors")),
        **mx.load(str(both / "adapter_model.safetensors")),
    }
    mx.save_safetensors(str(both / "adapter_model.safetensors"), weights)
    with pytest.raises(AdapterError, match=r"names mtp\.eh_proj twice, as .+ and as .+; keep one$"):
        lora.mount(shapes, both, "twice")
    assert adapted_layers(shapes) == set() and lora.mounted(shapes) == []
