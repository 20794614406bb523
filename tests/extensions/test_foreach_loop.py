"""Foreach loop: OF3's EMA update and per-sample clipping, key on against key off.

Both run OF3's own classes (``ExponentialMovingAverage``, ``PerSampleGradManager``)
on the same tensors; the key is read from the model's memory settings as the kit
attaches them to an ``OpenFold3`` model. On the CPU every foreach op runs per
tensor through the same kernels as OF3's loop, so results are compared bit for bit.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from of3_megafold import registry
from of3_megafold.extensions import foreach_loop

DECAY = 0.999


def _model(seed: int = 0) -> torch.nn.Module:
    """Linear layers of awkward sizes, a LayerNorm, a float buffer, a bf16 tensor
    (a second dtype group) and a parameter no loss reaches (no gradient)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 3)
    )
    model.register_buffer("scale", torch.rand(5))
    model[2].register_buffer("bf16_stat", torch.randn(3, 2).bfloat16())
    model.unused = torch.nn.Parameter(torch.randn(4))
    return model


def _set_key(model: torch.nn.Module, on: bool) -> None:
    """The memory settings the kit gives every submodule of an OpenFold3 model."""
    memory = types.SimpleNamespace(train={foreach_loop.FLAG: on}, eval={})
    for module in model.modules():
        object.__setattr__(module, registry.MEMORY_ATTR, memory)


@pytest.fixture
def foreach_calls(monkeypatch):
    """Counts of the foreach paths taken (a test that compares OF3 with itself
    fails here)."""
    calls = {"ema": 0, "norm": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(foreach_loop, "ema_update_",
                        counted("ema", foreach_loop.ema_update_))
    monkeypatch.setattr(foreach_loop, "global_norm",
                        counted("norm", foreach_loop.global_norm))
    return calls


def _perturb(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in model.state_dict().values():
            t.add_(torch.randn_like(t.float()).to(t.dtype))


@pytest.mark.parametrize("submodules", [None, ["0", "2"]])
def test_ema_equals_of3s_bit_for_bit(kit, foreach_calls, submodules):
    from openfold3.core.utils.exponential_moving_average import (
        ExponentialMovingAverage,
    )

    model = _model()
    emas = {on: ExponentialMovingAverage(model, DECAY, submodules) for on in (0, 1)}
    for ema in emas.values():
        ema.init_params(model)
    initial = {k: v.clone() for k, v in emas[0].params.items()}
    for _ in range(3):
        _perturb(model)
        for on, ema in emas.items():
            _set_key(model, bool(on))
            ema.update(model)
    assert foreach_calls["ema"] == 3
    for name, value in emas[0].params.items():
        assert torch.equal(emas[1].params[name], value), name
        skipped = submodules is not None and name.split(".")[0] not in submodules
        assert torch.equal(value, initial[name]) == skipped, name


def test_ema_without_matching_submodules_warns_and_keeps(kit):
    from openfold3.core.utils.exponential_moving_average import (
        ExponentialMovingAverage,
    )

    model = _model()
    _set_key(model, True)
    ema = ExponentialMovingAverage(model, DECAY, ["nowhere"])
    ema.init_params(model)
    before = {k: v.clone() for k, v in ema.params.items()}
    _perturb(model)
    with pytest.warns(UserWarning, match="No parameters found"):
        ema.update(model)
    assert all(torch.equal(ema.params[k], v) for k, v in before.items())


@pytest.mark.parametrize("on", [False, True])
def test_ema_integer_buffer_raises_as_of3s(kit, on):
    from openfold3.core.utils.exponential_moving_average import (
        ExponentialMovingAverage,
    )

    model = _model()
    model.register_buffer("steps", torch.tensor([3, 4]))
    _set_key(model, on)
    ema = ExponentialMovingAverage(model, DECAY)
    ema.init_params(model)
    with pytest.raises(RuntimeError, match="can't be cast"):
        ema.update(model)


def _manager(model: torch.nn.Module, clip: float | None):
    from openfold3.core.utils.grad_manager import PerSampleGradManager

    manager = PerSampleGradManager(gradient_clip_val=clip, log_grad_norm=True)
    manager.setup(model, types.SimpleNamespace(global_step=0), None)
    return manager


def _sample_grads(model: torch.nn.Module, seed: int, size: float) -> None:
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(torch.randn(6, 7))
    (size * (out**2).sum()).backward()


@pytest.mark.parametrize("clip", [0.5, None])
def test_clip_and_accumulate_equals_of3s_bit_for_bit(kit, foreach_calls, clip):
    model = _model()
    managers = {on: _manager(model, clip) for on in (0, 1)}
    # large gradients (clipped), small ones (kept), one sample without layer 0
    samples = [(1, 10.0, None), (2, 1e-4, None), (3, 5.0, {"0.weight", "0.bias"})]
    for seed, size, disabled in samples:
        clipped = {}
        for on, manager in managers.items():
            _sample_grads(model, seed, size)
            _set_key(model, bool(on))
            manager.clip_and_accumulate(disabled_params=disabled)
            clipped[on] = {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}
        assert clipped[0].keys() == clipped[1].keys()
        for name, grad in clipped[0].items():
            assert torch.equal(clipped[1][name], grad), name
    assert foreach_calls["norm"] == len(samples)
    stock, kit_ = managers[0], managers[1]
    for name, acc in stock.grad_accumulator.items():
        assert torch.equal(kit_.grad_accumulator[name], acc), name
    assert kit_.grad_accumulator["0.weight"].abs().sum() > 0
    assert "unused" not in kit_.parameter_participation_counts
    assert kit_.parameter_participation_counts == stock.parameter_participation_counts
    assert kit_.parameter_participation_counts["0.weight"] == 2
    assert kit_.accum_count == stock.accum_count == len(samples)
    for metric in ("avg_unclipped_norm_metric", "max_unclipped_norm_metric"):
        assert torch.equal(getattr(kit_, metric).compute(),
                           getattr(stock, metric).compute()), metric


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_global_norm_is_of3s(dtype):
    from openfold3.core.utils.grad_manager import compute_global_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in (1, 7, 129)]
    params.append(torch.nn.Parameter(torch.randn(3)))  # an fp32 group beside
    for p in params:
        p.grad = torch.randn_like(p) * 3
    expected, _ = compute_global_norm(params)
    got = foreach_loop.global_norm([p.grad for p in params])
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


def _wrapper_chain(function) -> list:
    """``function`` and the kit's functions it wraps, outermost first, down to
    OF3's (the last)."""
    chain = [function]
    while chain[-1].__module__.startswith("of3_megafold."):
        chain.append(chain[-1].__wrapped__)
    return chain


def test_deactivate_restores_of3s_functions(kit):
    from openfold3.core.utils.exponential_moving_average import (
        ExponentialMovingAverage as EMA,
    )
    from openfold3.core.utils.grad_manager import PerSampleGradManager as Manager

    from of3_megafold import activate, deactivate

    chains = [_wrapper_chain(EMA.update), _wrapper_chain(Manager.clip_and_accumulate)]
    assert all(len(chain) > 1 for chain in chains)
    deactivate()
    try:
        assert EMA.update is chains[0][-1]
        assert Manager.clip_and_accumulate is chains[1][-1]
    finally:
        activate()


def test_sequence_parallel_averages_before_the_foreach_clip(kit):
    """Both extensions patch ``clip_and_accumulate``: sequence parallelism's
    group average must run first, so its wrapper is the outer one."""
    from openfold3.core.utils.grad_manager import PerSampleGradManager

    modules = [f.__module__ for f in
               _wrapper_chain(PerSampleGradManager.clip_and_accumulate)]
    assert modules.index("of3_megafold.extensions.sequence_parallel") < modules.index(
        foreach_loop.__name__
    )


@pytest.mark.parametrize("on", [False, True])
def test_key_from_a_runner_config_reaches_the_model(kit, on):
    """The key set in ``model_update.custom`` as a user sets it, read through the
    memory settings the kit attaches to a model; ``eval`` has no such key."""
    from openfold3.projects.of3_all_atom.project_entry import (
        ModelUpdate,
        OF3ProjectEntry,
    )

    custom = {"settings": {"memory": {"train": {foreach_loop.FLAG: on}}}}
    config = OF3ProjectEntry().get_model_config_with_update(
        ModelUpdate(presets=["train"], custom=custom)
    )
    assert foreach_loop.FLAG not in config.settings.memory.eval
    model = _model()
    for module in model.modules():
        object.__setattr__(module, registry.MEMORY_ATTR, config.settings.memory)
    assert foreach_loop._enabled(model.eval()) is on
    assert registry.get(foreach_loop.NAME).requested(config) is on


def test_key_off_or_no_settings_is_of3s_path(kit):
    model = _model()
    assert not foreach_loop._enabled(model)
    _set_key(model, False)
    assert not foreach_loop._enabled(model)
    _set_key(model, True)
    assert foreach_loop._enabled(model)


def test_key_is_train_only_and_listed():
    key = registry.get(foreach_loop.NAME).keys
    assert [k.dotted for k in key] == ["settings.memory.train.use_foreach_loop"]
    table = registry.keys_markdown()
    assert "`settings.memory.train.use_foreach_loop`" in table
    assert "{train,eval}.use_foreach_loop" not in table
    assert "`settings.memory.{train,eval}.use_evoflash_attention`" in table


def test_of3_leaves_adams_foreach_to_torch(kit):
    """OF3's optimizer passes neither ``foreach`` nor ``fused``: torch then runs
    its foreach Adam for CUDA parameters, so the extension leaves Adam alone."""
    from openfold3.projects.of3_all_atom.config.model_config import model_config
    from openfold3.projects.of3_all_atom.runner import OpenFold3AllAtom

    runner = types.SimpleNamespace(config=model_config, model=_model(),
                                   last_lr_step=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = OpenFold3AllAtom.configure_optimizers(runner)["optimizer"]
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.defaults["foreach"] is None
    assert optimizer.defaults["fused"] is None
