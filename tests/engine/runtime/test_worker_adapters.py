"""Adapter and draft-model commands through the worker thread."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.api import (
    AdapterInfo,
    DoneEvent,
    ErrorEvent,
    Generate,
    GenerationParams,
    GetModelInfo,
    LoadDraftModel,
    LoadModel,
    ModelInfo,
    MountAdapter,
    SetActiveAdapters,
    UnloadModel,
    UnmountAdapter,
)
from engine.runtime.worker import EngineWorker

from .test_worker import HELLO, Events
from .tiny_folder import make_tiny_adapter, make_tiny_model_folder

PARAMS = GenerationParams(max_tokens=8, ignore_eos=True)


@pytest.fixture()
def worker():
    events = Events()
    w = EngineWorker(events)
    w.start()
    yield w, events
    assert w.shutdown(10)


def done(ev: Events, rid: int):
    end = ev.end_of(rid)
    assert isinstance(end, DoneEvent), end
    return end.result


def error(ev: Events, rid: int) -> str:
    end = ev.end_of(rid)
    assert isinstance(end, ErrorEvent), end
    assert end.message and "\n" not in end.message
    return end.message


def test_mount_activate_generate_unmount(worker, tiny_model_dir, tiny_adapter_dirs, tmp_path):
    w, ev = worker
    done(ev, w.submit(LoadModel(str(tiny_model_dir))))
    base = done(ev, w.submit(Generate("s", HELLO, PARAMS)))

    info = done(ev, w.submit(MountAdapter(str(tiny_adapter_dirs["alpha"]))))
    assert isinstance(info, AdapterInfo)
    assert (info.name, info.format, info.kind, info.rank, info.targets) == ("alpha", "mlx-lm", "lora", 4, 4)
    done(ev, w.submit(MountAdapter(str(tiny_adapter_dirs["beta"]), name="b")))
    status = done(ev, w.submit(SetActiveAdapters({"alpha": 1.0, "b": 0.5})))
    assert isinstance(status, ModelInfo) and status.active_adapters == {"alpha": 1.0, "b": 0.5}
    assert [a.name for a in status.adapters] == ["alpha", "b"]

    adapted = done(ev, w.submit(Generate("s", HELLO, PARAMS)))
    assert adapted.adapters == {"alpha": 1.0, "b": 0.5} and adapted.stats.cached_tokens == 0
    assert adapted.token_ids != base.token_ids
    # Still mounted and active for the next request.
    again = done(ev, w.submit(Generate("t", HELLO, PARAMS)))
    assert again.token_ids == adapted.token_ids

    assert error(ev, w.submit(MountAdapter(str(tiny_adapter_dirs["beta"]), name="b"))).startswith(
        "an adapter named 'b' is already mounted"
    )
    assert "not mounted" in error(ev, w.submit(SetActiveAdapters({"gamma": 1.0})))
    wrong = make_tiny_adapter(tmp_path / "wrong", seed=1, rank=2)
    (tmp_path / "wrong" / "adapters.safetensors").rename(tmp_path / "wrong" / "x")
    assert "no adapters.safetensors" in error(ev, w.submit(MountAdapter(str(wrong))))

    status = done(ev, w.submit(UnmountAdapter("alpha")))
    assert [a.name for a in status.adapters] == ["b"] and status.active_adapters == {"b": 0.5}
    done(ev, w.submit(SetActiveAdapters({})))
    assert done(ev, w.submit(Generate("s", HELLO, PARAMS))).token_ids == base.token_ids

    done(ev, w.submit(UnloadModel()))
    assert done(ev, w.submit(GetModelInfo())) is None
    assert "No model is loaded" in error(ev, w.submit(MountAdapter(str(tiny_adapter_dirs["alpha"]))))
    done(ev, w.submit(LoadModel(str(tiny_model_dir))))
    assert done(ev, w.submit(GetModelInfo())).adapters == []  # unloading dropped them


def test_mismatched_adapter_is_refused_with_the_shape(worker, tiny_model_dir, tmp_path):
    w, ev = worker
    done(ev, w.submit(LoadModel(str(tiny_model_dir))))
    big = make_tiny_adapter(tmp_path / "big", seed=1)
    import mlx.core as mx

    weights = dict(mx.load(str(big / "adapters.safetensors")))
    weights["model.layers.0.self_attn.q_proj.lora_a"] = mx.zeros((64, 4))
    mx.save_safetensors(str(big / "adapters.safetensors"), weights)
    message = error(ev, w.submit(MountAdapter(str(big))))
    assert "expects q_proj 64->32 but the model has 32->32" in message
    assert done(ev, w.submit(GetModelInfo())).adapters == []


def test_draft_model_commands(worker, tiny_model_dir, tiny_draft_dir, tmp_path):
    w, ev = worker
    assert "No model is loaded" in error(ev, w.submit(LoadDraftModel(str(tiny_draft_dir))))
    done(ev, w.submit(LoadModel(str(tiny_model_dir))))
    plain = done(ev, w.submit(Generate("p", HELLO, PARAMS)))
    draft_params = replace(PARAMS, speculative="draft", num_draft_tokens=3)
    assert "needs one loaded" in error(ev, w.submit(Generate("s", HELLO, draft_params)))

    info = done(ev, w.submit(LoadDraftModel(str(tiny_draft_dir))))
    assert isinstance(info, ModelInfo) and info.family == "llama"
    assert done(ev, w.submit(GetModelInfo())).draft_model == info.path
    result = done(ev, w.submit(Generate("s", HELLO, draft_params)))
    assert result.token_ids == plain.token_ids and result.stats.draft_tokens > 0

    other = make_tiny_model_folder(tmp_path / "other-vocab", corpus=["zebra quartz jukebox vexing wizard"] * 4)
    message = error(ev, w.submit(LoadDraftModel(str(other))))
    assert message.startswith("the draft model's vocabulary does not match the target's")
    assert done(ev, w.submit(GetModelInfo())).draft_model == info.path  # the refused one replaced nothing

    assert done(ev, w.submit(LoadDraftModel(None))) is None
    assert done(ev, w.submit(GetModelInfo())).draft_model is None
    ngram = done(ev, w.submit(Generate("n", HELLO, replace(PARAMS, speculative="ngram"))))
    assert ngram.token_ids == plain.token_ids
