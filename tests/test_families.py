"""The family registry: one folder per family that adds something to the generic path, one line registering it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import transformers
from generic_families import FAMILIES, tiny_config

from workbench import BackendConfig
from workbench.models import generic
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.families import GENERIC, REGISTERED, Family, Preset, _by_model_type, family_for
from workbench.models.families.preset import TINY_COMMON
from workbench.models.generic import TESTED_FAMILIES
from workbench.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "workbench" / "models" / "families"


def _folders() -> list[str]:
    return sorted(p.name for p in FOLDER.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def test_every_family_folder_is_registered_once_and_named_by_its_model_type():
    assert _folders() == sorted(f.model_type for f in REGISTERED)
    assert len(REGISTERED) >= 4
    for family in REGISTERED:
        assert family_for(family.model_type) is family
        known = family.model_type in transformers.CONFIG_MAPPING
        assert known or _version() < NEWER_THAN.get(family.model_type, (0, 0)), family.model_type


# Registered families that older Transformers lack (the GPU image's 5.17), with a release known to have them: a folder
# for a model_type no installed Transformers knows is never matched, and a typo in one is still caught.
NEWER_THAN = {"ergo": (5, 25), "lara_mini": (5, 25)}


def _version() -> tuple[int, int]:
    return tuple(int(n) for n in transformers.__version__.split(".")[:2])


def test_a_model_type_without_a_folder_gets_the_generic_path_which_adds_nothing():
    family = family_for("qwen2_moe")
    assert family is GENERIC and family_for(None) is GENERIC
    assert family.install_extras(None, None) == {} and family.expert_rows(None, "triton") is None
    assert not family.presets and not family.sinks_by_default and not family.biased_experts


def test_only_a_familys_own_folder_and_the_registry_import_its_modules():
    # "nothing outside a family's folder names it": the generic path reaches a family through family_for only
    offenders = []
    for path in sorted((ROOT / "workbench").rglob("*.py")):
        rel = path.relative_to(ROOT / "workbench")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                parts = name.split(".")
                if parts[:3] != ["workbench", "models", "families"] or len(parts) < 4:
                    continue
                owner = parts[3]
                if owner in ("family", "preset", "gated_deltanet"):
                    continue  # the record types every family and the registry share; a layout two families share
                if rel.parts[:3] != ("models", "families", owner) and rel != Path("models/families/__init__.py"):
                    offenders.append(f"{rel} imports {name}")
    assert offenders == []


def test_presets_come_from_the_family_folders_in_registration_order():
    assert list(PRESETS) == [p.name for f in REGISTERED for p in f.presets]
    # a family may add no presets (Ergo adds only its experts' rows)
    assert {p.model_type for p in PRESETS.values()} == {f.model_type for f in REGISTERED if f.presets}


def test_every_registered_family_is_compared_with_transformers_in_the_tests():
    assert set(TESTED_FAMILIES) == set(FAMILIES)
    assert {f.model_type for f in REGISTERED} <= set(TESTED_FAMILIES)


def test_the_registry_refuses_a_repeated_family_and_a_family_holding_another_ones_presets():
    with pytest.raises(ValueError, match="distinct model_types"):
        _by_model_type((Family("mixtral", "Mixtral"), Family("mixtral", "Mixtral again")))
    stray = Preset("tiny-x", "olmoe", "OLMoE", lambda: dict(TINY_COMMON))
    with pytest.raises(ValueError, match="presets of another model_type"):
        Family("mixtral", "Mixtral", presets=(stray,))


def test_a_familys_hooks_are_what_the_generic_path_installs(monkeypatch):
    # what adding a family takes: its record; the generic path calls its hooks (here a Mixtral record with an extra)
    calls = []

    def install_extras(model, backend):
        calls.append(type(model).__name__)
        return {"float32_router": 3}

    added = Family("mixtral", "Mixtral", install_extras=install_extras)
    monkeypatch.setattr(generic, "family_for", lambda model_type: added if model_type == "mixtral" else GENERIC)
    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), backend=BackendConfig(experts="grouped_mm"))
    assert calls == ["MixtralForCausalLM"]
    assert type(model).__name__ == "MixtralForCausalLM"
