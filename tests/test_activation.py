"""The registry and activation against OpenFold3's real config machinery.

A test-only extension (key ``settings.memory.train.use_megafold_selftest``, a choice
key under the diffusion loss, a patch of a stand-in function) exercises every path
the real extensions use.
"""

import pytest

from of3_megafold import activate, deactivate, registry
from of3_megafold.errors import ExtensionUnavailableError, KitConfigError
from tests.extensions import selftest_target

STOCK_COMPUTE = selftest_target.compute  # before any test patches it

SELFTEST_KEY = registry.ConfigKey(
    ("settings", "memory", "train", "use_megafold_selftest"),
    False,
    "test-only flag",
)
CHOICE_KEY = registry.ConfigKey(
    ("architecture", "loss_module", "diffusion", "megafold_selftest_mode"),
    "stock",
    "test-only choice",
    choices=("stock", "fast"),
)


def _patch_compute(original):
    def compute(x):
        if registry.forced_variant("selftest") is not None:
            return original(x) * 10.0
        return original(x)

    return compute


@pytest.fixture
def selftest(monkeypatch):
    """Register the test-only extension; ``state['available']`` toggles it."""
    deactivate()
    state = {"available": True}
    ext = registry.register(
        registry.Extension(
            name="selftest",
            summary="test-only",
            keys=(SELFTEST_KEY, CHOICE_KEY),
            requested=lambda c: (
                bool(SELFTEST_KEY.read(c)) or CHOICE_KEY.read(c) != "stock"
            ),
            enable_update={
                "settings": {"memory": {"train": {"use_megafold_selftest": True}}}
            },
            device_check=lambda: (
                (True, "ok")
                if state["available"]
                else (False, "no frobnicator; install frobnicator>=2")
            ),
            patches=(
                registry.Patch(
                    "tests.extensions.selftest_target:compute", _patch_compute
                ),
            ),
            variants=("x10",),
        )
    )
    activate()
    yield state, ext
    deactivate()
    registry.unregister("selftest")


def _entry():
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    return OF3ProjectEntry(), ModelUpdate


def test_keys_have_stock_defaults_and_can_be_set(selftest):
    entry, ModelUpdate = _entry()
    config = entry.get_model_config_with_update(ModelUpdate(presets=["train"]))
    assert config.settings.memory.train.use_megafold_selftest is False
    custom = {"settings": {"memory": {"train": {"use_megafold_selftest": True}}}}
    config = entry.get_model_config_with_update(ModelUpdate(custom=custom))
    assert config.settings.memory.train.use_megafold_selftest is True


def test_unknown_key_still_fails_like_of3(selftest):
    entry, ModelUpdate = _entry()
    custom = {"settings": {"memory": {"train": {"use_megafold_selftset": True}}}}
    with pytest.raises(KeyError, match="locked"):
        entry.get_model_config_with_update(ModelUpdate(custom=custom))


def test_bad_choice_names_key_value_and_allowed(selftest):
    entry, ModelUpdate = _entry()
    custom = {
        "architecture": {
            "loss_module": {"diffusion": {"megafold_selftest_mode": "fsat"}}
        }
    }
    with pytest.raises(KitConfigError) as err:
        entry.get_model_config_with_update(ModelUpdate(custom=custom))
    message = str(err.value)
    assert "megafold_selftest_mode" in message
    assert "'fsat'" in message
    assert "'stock', 'fast'" in message


def test_requested_but_unavailable_names_the_fix(selftest):
    state, _ = selftest
    state["available"] = False
    entry, ModelUpdate = _entry()
    custom = {"settings": {"memory": {"train": {"use_megafold_selftest": True}}}}
    with pytest.raises(ExtensionUnavailableError, match="install frobnicator"):
        entry.get_model_config_with_update(ModelUpdate(custom=custom))
    # Not requested: an unavailable extension is no obstacle.
    entry.get_model_config_with_update(ModelUpdate())


def test_kill_switch(selftest, monkeypatch):
    _, ext = selftest
    monkeypatch.setenv("OF3_MEGAFOLD_DISABLE", "selftest")
    ok, reason = ext.available()
    assert not ok and "OF3_MEGAFOLD_DISABLE" in reason


def test_patch_is_inert_until_forced(selftest):
    assert selftest_target.compute(1.0) == 2.0
    activate(force=["selftest"])
    assert registry.forced_variant("selftest") == "x10"
    assert selftest_target.compute(1.0) == 20.0
    activate()
    assert selftest_target.compute(1.0) == 2.0


def test_a_patched_function_keeps_of3s_docstring_and_reaches_the_original(selftest):
    original = selftest_target.compute.__wrapped__
    assert original(1.0) == 2.0 and original is not selftest_target.compute
    assert selftest_target.compute.__doc__ == "x + 1"
    deactivate()
    assert not hasattr(selftest_target.compute, "__wrapped__")


def test_force_all_leaves_out_what_is_unavailable(selftest):
    state, _ = selftest
    state["available"] = False
    activate(force="all")
    assert registry.forced_variant("selftest") is None
    state["available"] = True
    activate(force="all")
    assert registry.forced_variant("selftest") == "x10"
    activate()


def test_force_rejects_unknown_names_and_unavailable(selftest):
    state, _ = selftest
    with pytest.raises(KitConfigError, match="known extensions"):
        activate(force=["no_such_extension"])
    with pytest.raises(KitConfigError, match="variants: x10"):
        activate(force=["selftest:x100"])
    state["available"] = False
    with pytest.raises(ExtensionUnavailableError, match="frobnicator"):
        activate(force="selftest")


def test_activate_is_idempotent_and_deactivate_restores(selftest):
    from openfold3.projects.of3_all_atom.config.model_config import model_config

    patched = selftest_target.compute
    assert patched is not STOCK_COMPUTE
    activate()
    activate()
    assert selftest_target.compute is patched
    assert "use_megafold_selftest" in model_config.settings.memory.train
    deactivate()
    assert "use_megafold_selftest" not in model_config.settings.memory.train
    assert selftest_target.compute is STOCK_COMPUTE
    activate()  # the fixture's teardown expects an active kit


def test_runner_yaml_model_update_validates_through_of3(selftest):
    import yaml

    entry, ModelUpdate = _entry()
    runner = yaml.safe_load(
        """
        model_update:
          presets: [train]
          custom:
            settings:
              memory:
                train:
                  use_megafold_selftest: true
        """
    )
    update = ModelUpdate.model_validate(runner["model_update"])
    config = entry.get_model_config_with_update(update)
    assert config.settings.memory.train.use_megafold_selftest is True


def test_module_flag_reads_the_model_mode():
    import torch
    from ml_collections import ConfigDict

    memory = ConfigDict({"train": {"flag": True}, "eval": {"flag": False}})
    module = torch.nn.Linear(2, 2)
    assert registry.module_flag(module, "flag") is False  # built outside OF3
    object.__setattr__(module, registry.MEMORY_ATTR, memory)
    module.train()
    assert registry.module_flag(module, "flag") is True
    module.eval()
    assert registry.module_flag(module, "flag") is False


def _extension_patching(target: str) -> registry.Extension:
    return registry.Extension(
        name="selftest_patch_target",
        summary="test-only",
        keys=(),
        requested=lambda c: False,
        enable_update={},
        patches=(registry.Patch(target, lambda original: original),),
    )


def test_patch_of_a_module_with_missing_dependencies_is_skipped():
    """A module that needs a package missing here can be called by nothing, so
    activation skips its patch (a model-only install lacks OF3's data packages)."""
    deactivate()
    registry.register(
        _extension_patching("tests.extensions.selftest_missing_dep:compute")
    )
    try:
        activate()
        from of3_megafold.activation import is_active

        assert is_active()
    finally:
        deactivate()
        registry.unregister("selftest_patch_target")


def test_patch_of_a_missing_openfold3_module_fails():
    """A target inside openfold3 that does not exist is a kit bug, not a missing
    optional package: activation fails and leaves OF3 stock."""
    deactivate()
    registry.register(_extension_patching("openfold3.no_such_module:compute"))
    try:
        with pytest.raises(ModuleNotFoundError):
            activate()
    finally:
        deactivate()
        registry.unregister("selftest_patch_target")


@pytest.mark.parametrize(
    "error",
    [
        ModuleNotFoundError("No module named 'kalign'", name="kalign"),
        ImportError(
            "cannot import name 'pad_to_world_size' from partially initialized "
            "module 'openfold3.core.data.framework.single_datasets.dataset_utils'",
            name="openfold3.core.data.framework.single_datasets.dataset_utils",
        ),
    ],
    ids=["missing-package", "half-imported-openfold3-module"],
)
def test_unimportable_data_pipeline_leaves_the_model_extensions_active(
    monkeypatch, error
):
    """Seen on the GPU machine (kalign missing there): OF3's data pipeline does not
    import, so EvoPipe's dataset is not registered, and activation still succeeds."""
    from of3_megafold.data import dataset

    def unimportable():
        raise error

    deactivate()
    monkeypatch.setattr(dataset, "register", unimportable)
    try:
        activate()
        from of3_megafold.activation import is_active

        assert is_active()
    finally:
        deactivate()


def test_kit_import_errors_in_dataset_registration_still_fail(monkeypatch):
    from of3_megafold.data import dataset

    def broken():
        raise ImportError("cannot import name 'x'", name="of3_megafold.data.x")

    deactivate()
    monkeypatch.setattr(dataset, "register", broken)
    try:
        with pytest.raises(ImportError):
            activate()
    finally:
        deactivate()


def test_forced_extension_skips_the_of3_tests_it_changes_on_purpose():
    """``of3_megafold.testing`` skips, with the reason, only the listed OF3 tests and
    only while their extension is forced."""
    from of3_megafold import activate, testing

    class Item:
        def __init__(self, nodeid):
            self.nodeid, self.markers = nodeid, []

        def add_marker(self, marker):
            self.markers.append(marker)

    listed = ("openfold3/tests/test_diffusion_loss.py::TestBondLossMemory::"
              "test_sparse_uses_less_or_equal_reserved_memory[1000]")
    other = "openfold3/tests/test_diffusion_loss.py::TestDiffusionLoss::test_bond_loss"
    try:
        for force, expect_skip in (((), False), (("smooth_lddt",), True)):
            activate(force=force)
            items = [Item(listed), Item(other)]
            testing.pytest_collection_modifyitems(None, items)
            assert not items[1].markers
            if expect_skip:
                (marker,) = items[0].markers
                assert marker.name == "skip" and "smooth_lddt forced" in (
                    marker.kwargs["reason"])
            else:
                assert not items[0].markers
    finally:
        activate()


def test_memory_flag_extension_builds_the_shared_record():
    from ml_collections import ConfigDict

    ext = registry.memory_flag_extension(
        "flagged",
        "use_flagged",
        help="runs flagged work",
        summary="flagged work, faster",
        exclusive_with=("use_of3_kernel",),
        exclusive_what="kernel",
        requires=("torch",),
    )
    assert [key.yaml_path for key in ext.keys] == [
        "model_update.custom.settings.memory.train.use_flagged",
        "model_update.custom.settings.memory.eval.use_flagged",
    ]
    assert [key.help for key in ext.keys] == [
        "train: runs flagged work",
        "eval: runs flagged work",
    ]
    assert all(key.default is False for key in ext.keys)
    train_on = {"settings": {"memory": {"train": {"use_flagged": True}}}}
    assert ext.enable_update == train_on
    assert ext.docs == "docs/extensions/flagged.md" and ext.requires == ("torch",)

    def config(train: dict, eval_: dict) -> ConfigDict:
        return ConfigDict({"settings": {"memory": {"train": train, "eval": eval_}}})

    off = config({"use_flagged": False}, {"use_flagged": False})
    on = config({"use_flagged": False}, {"use_flagged": True})
    assert not ext.requested(off) and ext.requested(on)
    ext.check_config(config({"use_flagged": True}, {"use_flagged": False}))
    both = {"use_flagged": True, "use_of3_kernel": True}
    clash = config({"use_flagged": False}, both)
    with pytest.raises(KitConfigError, match="use_of3_kernel in settings.memory.eval"):
        ext.check_config(clash)
