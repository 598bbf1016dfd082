"""Adapters on a loaded model through ModelHost: KV prefix reuse never crosses adapter sets."""

from __future__ import annotations

import pytest

from engine.api import GenerationParams
from engine.errors import AdapterError
from engine.runtime.host import ModelHost

TURN1 = [{"role": "user", "content": "hello how are you"}]
PARAMS = GenerationParams(max_tokens=10, ignore_eos=True)


def turn2(reply: str) -> list[dict]:
    return TURN1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "and you today"}]


@pytest.fixture()
def host(tiny_model_dir, tiny_adapter_dirs):
    h = ModelHost()
    h.load(str(tiny_model_dir))
    for name, folder in tiny_adapter_dirs.items():
        h.mount_adapter(str(folder), name)
    return h


def fresh(host: ModelHost, messages, params=PARAMS):
    """The reference: a session that has never seen anything, under the current adapters."""
    host.drop_session("fresh")
    result = host.generate("fresh", messages, params)
    assert result.stats.cached_tokens == 0
    return result


def test_cache_is_not_reused_across_adapter_sets(host):
    first = host.generate("chat", TURN1, PARAMS)
    messages = turn2(first.text)
    base = fresh(host, messages)

    host.set_active_adapters({"alpha": 1.0})
    adapted = host.generate("chat", messages, PARAMS)
    assert adapted.stats.cached_tokens == 0  # the turn-1 KV was computed without the adapter
    assert adapted.adapters == {"alpha": 1.0}
    assert adapted.token_ids == fresh(host, messages).token_ids
    assert adapted.token_ids != base.token_ids  # the adapter changes the reply: the test can fail

    # Same adapters again: the prefix is reused, and the reply is still the fresh one.
    again = host.generate("chat", messages, PARAMS)
    assert again.stats.cached_tokens > 0
    assert again.token_ids == adapted.token_ids

    # Another scale is another adapter set.
    host.set_active_adapters({"alpha": 0.5})
    half = host.generate("chat", messages, PARAMS)
    assert half.stats.cached_tokens == 0
    assert half.token_ids == fresh(host, messages).token_ids

    host.set_active_adapters({})
    back = host.generate("chat", messages, PARAMS)
    assert back.stats.cached_tokens == 0 and back.adapters == {}
    assert back.token_ids == base.token_ids


def test_two_adapters_and_unmount(host):
    messages = turn2("fine thanks")
    host.set_active_adapters({"alpha": 1.0, "beta": 0.7})
    both = host.generate("chat", messages, PARAMS)
    assert both.token_ids == fresh(host, messages).token_ids
    assert host.info.active_adapters == {"alpha": 1.0, "beta": 0.7}
    assert [a.name for a in host.info.adapters] == ["alpha", "beta"]
    assert host.info.adapters[0].targets == 4 and host.info.adapters[0].rank == 4

    host.unmount_adapter("beta")  # an active one: the set changes
    only_alpha = host.generate("chat", messages, PARAMS)
    assert only_alpha.stats.cached_tokens == 0 and only_alpha.adapters == {"alpha": 1.0}
    assert only_alpha.token_ids == fresh(host, messages).token_ids
    assert [a.name for a in host.info.adapters] == ["alpha"]

    # Mounting without activating leaves the computation, hence the cache, as it was.
    host.mount_adapter(str(host.info.adapters[0].path), "alpha-again")
    reuse = host.generate("chat", messages, PARAMS)
    assert reuse.stats.cached_tokens > 0 and reuse.token_ids == only_alpha.token_ids


def test_adapters_go_with_the_model(host, tiny_model_dir):
    host.set_active_adapters({"alpha": 1.0})
    host.load(str(tiny_model_dir))
    assert host.info.adapters == [] and host.info.active_adapters == {}
    with pytest.raises(AdapterError, match="not mounted"):
        host.set_active_adapters({"alpha": 1.0})
