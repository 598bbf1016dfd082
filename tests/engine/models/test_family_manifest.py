"""The family manifest is the one place a family is declared: every registry reads it."""

from __future__ import annotations

import subprocess
import sys

from engine.decode.batch import BATCHABLE_TYPES
from engine.media.towers import TOWERS
from engine.models import SUPPORTED
from engine.models.embedder import EMBEDDING_FAMILIES
from engine.models.families import FAMILIES, Family


def test_every_registry_is_read_from_the_manifest():
    assert SUPPORTED == {t: f.module for t, f in FAMILIES.items()}
    assert TOWERS == {t: dict(f.towers) for t, f in FAMILIES.items() if f.towers}
    assert BATCHABLE_TYPES == {t for t, f in FAMILIES.items() if f.batches}
    assert EMBEDDING_FAMILIES == {t: f.embeds for t, f in FAMILIES.items() if f.embeds}


def test_new_capabilities_are_off_until_a_family_sets_them():
    family = Family("llama")
    assert (family.pages, family.shards, family.streams_experts, family.batches) == (False, False, False, False)


def test_the_manifest_reads_without_mlx():
    code = "import sys, engine.models.families; print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
