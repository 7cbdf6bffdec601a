"""The tokenizer-only targets (#27 item 5): where they apply, and the processor's moved import."""

import logging
import types

import pytest

from ray_runai_shim import patches
from ray_runai_shim.tables import targets
from ray_runai_shim.tables.support import TOKENIZER, plan_for

TOKENIZER_TARGETS = [t for t in targets.TARGETS if t.patch == TOKENIZER]


@pytest.mark.parametrize("version", ["2.45.0", "2.55.1", "2.56.1", "2.58.1", "2.60.0"])
def test_every_release_that_drops_tokenizer_files_gets_the_patch(version):
    """2.45-2.55 drop chat_template.jinja too; 2.56-2.60 still drop vocab.json/merges.txt/..."""
    assert TOKENIZER in plan_for(version).patches


@pytest.mark.parametrize("version", ["2.43.0", "2.44.1", "2.61.0"])
def test_releases_outside_get_no_tokenizer_patch(version):
    assert TOKENIZER not in plan_for(version).patches


def test_the_stage_targets_and_the_processor_target():
    modules = {t.module: t for t in TOKENIZER_TARGETS}
    assert set(modules) == {targets.CHAT_TEMPLATE_STAGE, targets.TOKENIZE_STAGE, targets.PROCESSOR_MODULE}
    assert all(t.attr == "download_model_files" and t.wrapper == "ray_runai_shim.integrations.tokenizer:download"
               for t in TOKENIZER_TARGETS)
    # The stages hold the name in every release: a missing one is Ray changing shape (a WARNING).
    assert not modules[targets.CHAT_TEMPLATE_STAGE].if_has and not modules[targets.TOKENIZE_STAGE].if_has
    # Ray 2.59+ import it inside build_vllm_engine_processor: no module-level name there.
    assert modules[targets.PROCESSOR_MODULE].if_has == "download_model_files"


def test_a_processor_module_without_the_name_is_skipped_quietly(caplog):
    [target] = [t for t in TOKENIZER_TARGETS if t.module == targets.PROCESSOR_MODULE]
    module = types.ModuleType(targets.PROCESSOR_MODULE)  # as 2.59/2.60 leave it: no download_model_files
    module.build_vllm_engine_processor = lambda *a, **k: None
    with caplog.at_level(logging.DEBUG, logger="ray.runai_shim"):
        patches._apply(target, module)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "does not apply" in caplog.text
    assert not hasattr(module, "download_model_files")
