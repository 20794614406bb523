"""The embedded tiny training set and the demo training run.

``ensure_demo_dataset()`` builds (once, into the user cache) a real OF3 training
set from the test data the openfold3 wheel ships; ``run_demo_training()`` trains
OF3 on it with ``runner_yamls/demo.yml`` and writes a checkpoint, ``losses.csv``
and ``losses.png``. See ``docs/demo.md``.

The training half imports Lightning, so it loads on first use.
"""

from of3_megafold.demo.build import (
    DemoBuildError,
    DemoSourceMissingError,
    default_cache_root,
    demo_dataset_paths,
    ensure_demo_dataset,
)

_TRAIN_NAMES = ("run_demo_training", "resolve_runner_yaml", "loss_problems")

__all__ = [
    "DemoBuildError",
    "DemoSourceMissingError",
    "default_cache_root",
    "demo_dataset_paths",
    "ensure_demo_dataset",
    *_TRAIN_NAMES,
]


def __getattr__(name: str):
    if name in _TRAIN_NAMES:
        from of3_megafold.demo import train

        return getattr(train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
