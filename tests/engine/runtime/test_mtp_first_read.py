"""The built-in MTP layer is read on the first request that drafts with it (Qwen3.5 family).

On a tiny Qwen3.5 checkpoint (the transformers golden, float32, with a random MTP layer in
the Hub's layout appended):

* that read is the request's "load" progress, with the layer's size and a fraction per
  chunk read, on the first MTP request only;
* an adapter mounted before the read whose weights name modules inside the MTP layer
  covers it once read: the drafts equal, bit for bit, those of the layer read first and
  the adapter mounted after (LoRA and DoRA, both spellings of the path); unmounting gives
  back the plain layer; an adapter that names nothing inside it leaves it plain;
* looking a path up never builds an MTP layer the checkpoint lacks.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.api import GenerationParams, ProgressEvent, SamplingParams
from engine.errors import AdapterError
from engine.models.lora import LoRAHost, adapter_set
from engine.runtime import loading
from engine.runtime.host import ModelHost
from engine.runtime.memory import format_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_goldens import GOLDEN  # noqa: E402
from spec_models import first_draft_logits, mtp_hub_weights  # noqa: E402
from test_hybrid_families import build  # noqa: E402

from .test_memory_plan_mtp import held_bytes, with_tokenizer  # noqa: E402

PROMPT = json.loads((GOLDEN / "qwen3_5" / "expected.json").read_text())["prompt_ids"][:24]
GREEDY = GenerationParams(max_tokens=10, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
MTP = replace(GREEDY, speculative="mtp", num_draft_tokens=2)


def qwen_folder(root: Path, tokenizer_dir: Path, with_mtp: bool = True) -> Path:
    """The Qwen3.5 golden as a model folder, float32 on disk (drafts compare bit for bit)."""
    folder = root / ("qwen3_5-mtp" if with_mtp else "qwen3_5")
    folder.mkdir()
    config = json.loads((GOLDEN / "qwen3_5" / "config.json").read_text())
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(GOLDEN / "qwen3_5" / "model.safetensors")).items()}
    if with_mtp:
        config["mtp_num_hidden_layers"] = 1
        weights.update(mtp_hub_weights(build("qwen3_5")[0]))
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return with_tokenizer(folder, tokenizer_dir)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_model_dir) -> Path:
    return qwen_folder(tmp_path_factory.mktemp("mtp_read"), tiny_model_dir)


@pytest.fixture(scope="module")
def shapes(folder):
    """The model with its MTP layer loaded, to size adapters by."""
    return loading.load_model(folder, memory_budget=1 << 34, mtp=True).model


def peft_adapter(root: Path, paths: list[str], shapes, dora: bool = False, spelled: str = "", seed: int = 0) -> Path:
    """A PEFT adapter (rank 4) on the linear layers at ``paths``, each named ``spelled`` +
    its path, with weights large enough to move the drafts."""
    folder = root / f"adapter-{seed}-{'dora' if dora else 'lora'}"
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": dora, "target_modules": ["q_proj", "fc"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for path in paths:
        out_dims, in_dims = _module(shapes, path).weight.shape
        key = f"base_model.model.{spelled}{path}"
        weights[f"{key}.lora_A.weight"] = mx.array(0.3 * rng.standard_normal((4, in_dims)), dtype=mx.float32)
        weights[f"{key}.lora_B.weight"] = mx.array(0.3 * rng.standard_normal((out_dims, 4)), dtype=mx.float32)
        if dora:
            weights[f"{key}.lora_magnitude_vector"] = mx.array(1 + 0.5 * rng.random(out_dims), dtype=mx.float32)
    mx.save_safetensors(str(folder / "adapter_model.safetensors"), weights)
    return folder


def _module(model, path: str):
    node = model
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    return node


def adapted_layers(module) -> set[str]:
    return {p for p, m in module.named_modules() if isinstance(m, LoRAHost)}


def loaded(folder: Path) -> ModelHost:
    host = ModelHost()
    host.load(str(folder), budget=1 << 34)
    assert "mtp" not in host.model  # set apart, unread
    return host


# ---- the read shows as progress ------------------------------------------------------------------


def test_the_first_mtp_request_reports_the_read_once(folder, monkeypatch):
    monkeypatch.setattr(loading, "READ_CHUNK_BYTES", 8 << 10)  # a few chunks of the tiny layer
    host = loaded(folder)
    size = host.info.plan.mtp_bytes
    requests: list[list[object]] = []

    def run(params: GenerationParams) -> list[ProgressEvent]:
        requests.append([])
        host.generate_ids(PROMPT, params, requests[-1].append, request_id=len(requests))
        return [e for e in requests[-1] if isinstance(e, ProgressEvent) and e.stage == "load"]

    assert run(GREEDY) == []  # plain decoding never reads it
    reads = run(MTP)
    assert {(e.request_id, e.message) for e in reads} == {
        (2, f"Reading the built-in MTP layer ({format_bytes(size)})…")
    }
    done = [e.done for e in reads]
    assert done[0] == 0 and all(e.total == size for e in reads)
    assert done == sorted(set(done)) and done[-1] == size and len(done) > 3  # a fraction per chunk
    assert requests[1][: len(reads)] == reads  # before the prompt's prefill and any token
    assert "mtp" in host.model and held_bytes(host.model.mtp) == size
    assert run(MTP) == []  # read once: later requests draft at once
    assert host.generate_ids(PROMPT, MTP).token_ids == host.generate_ids(PROMPT, GREEDY).token_ids


# ---- adapters mounted before the read ------------------------------------------------------------

MTP_TARGETS = ["mtp.layers.0.self_attn.q_proj", "mtp.fc"]
IN_MTP = {p.removeprefix("mtp.") for p in MTP_TARGETS}


def read_then_mount(folder: Path, adapter: Path, name: str, ids: list[int]) -> tuple[ModelHost, mx.array, mx.array]:
    """The reference for an adapter covering the MTP layer: the layer read first (by an MTP
    request), then the adapter mounted and made active. Returns the host and its first
    drafts' logits before and after the mount."""
    host = loaded(folder)
    host.generate_ids(ids, MTP)
    plain, _ = first_draft_logits(host.model, ids)
    host.mount_adapter(str(adapter), name)
    host.set_active_adapters({name: 1.0})
    reference, _ = first_draft_logits(host.model, ids)
    return host, plain, reference


@pytest.mark.parametrize("dora, spelled", [(False, ""), (True, "model.")], ids=["lora", "dora-model.mtp"])
def test_an_adapter_mounted_before_the_read_covers_the_mtp_layer(folder, shapes, tmp_path, dora, spelled):
    adapter = peft_adapter(tmp_path, MTP_TARGETS, shapes, dora=dora, spelled=spelled)
    # The layer read first, then the adapter mounted: the reference.
    after, plain_drafts, reference = read_then_mount(folder, adapter, "mtp-tuned", PROMPT)
    assert adapted_layers(after.model.mtp) == IN_MTP
    assert not mx.allclose(reference, plain_drafts, atol=1e-2).item()  # the adapter moves the drafts

    # The adapter mounted first, then the layer read by the first MTP request.
    before = loaded(folder)
    assert before.mount_adapter(str(adapter), "mtp-tuned").targets == len(MTP_TARGETS)
    assert "mtp" not in before.model
    before.set_active_adapters({"mtp-tuned": 1.0})
    drafted = before.generate_ids(PROMPT, MTP)
    assert drafted.token_ids == before.generate_ids(PROMPT, GREEDY).token_ids and drafted.stats.draft_tokens > 0
    assert adapted_layers(before.model.mtp) == IN_MTP and adapter_set(before.model).waiting == {}
    drafts, _ = first_draft_logits(before.model, PROMPT)
    assert mx.array_equal(drafts, reference).item()  # bit for bit, as if loaded with the model

    before.unmount_adapter("mtp-tuned")
    assert adapted_layers(before.model) == set()
    unmounted, _ = first_draft_logits(before.model, PROMPT)
    assert mx.array_equal(unmounted, plain_drafts).item()


def test_an_adapter_unmounted_before_the_read_leaves_nothing_behind(folder, shapes, tmp_path):
    host = loaded(folder)
    host.mount_adapter(str(peft_adapter(tmp_path, MTP_TARGETS, shapes)), "gone")
    host.set_active_adapters({"gone": 1.0})
    host.unmount_adapter("gone")
    host.generate_ids(PROMPT, MTP)
    assert adapted_layers(host.model) == set() and adapter_set(host.model).waiting == {}


def test_an_adapter_that_names_nothing_in_the_mtp_layer_leaves_it_plain(folder, shapes, tmp_path):
    reference = loaded(folder)
    reference.generate_ids(PROMPT, MTP)
    plain_drafts, _ = first_draft_logits(reference.model, PROMPT)

    target = "model.layers.1.self_attn.q_proj"
    host = loaded(folder)
    host.mount_adapter(str(peft_adapter(tmp_path, [target], shapes, seed=1)), "body")
    host.set_active_adapters({"body": 0.0})  # mounted, acting on nothing: the target computes as plain
    host.generate_ids(PROMPT, MTP)
    assert adapted_layers(host.model) == {target} and adapted_layers(host.model.mtp) == set()
    drafts, _ = first_draft_logits(host.model, PROMPT)
    assert mx.array_equal(drafts, plain_drafts).item()


def test_looking_up_a_path_never_builds_an_mtp_layer(tmp_path, tiny_model_dir, shapes):
    """A checkpoint without MTP layers (mlx-lm's conversions drop them): an adapter naming one
    is refused, and the family's renaming of the path must not build one with random weights."""
    host = ModelHost()
    host.load(str(qwen_folder(tmp_path, tiny_model_dir, with_mtp=False)), budget=1 << 34)
    adapter = peft_adapter(tmp_path, MTP_TARGETS[:1], shapes, spelled="model.")
    with pytest.raises(AdapterError, match="which this model does not have"):
        host.mount_adapter(str(adapter), "nowhere")
    assert "mtp" not in host.model and not host.info.mtp
