"""Extension tests build OF3's modules on the CPU; their kernel paths need the Triton
interpreter (CI and pixi's ``cpu`` environment set ``TRITON_INTERPRET=1``)."""

import pytest
import torch


@pytest.fixture
def kit():
    """The kit active with nothing forced, before and after the test (a test that
    forces an extension cannot leak it into the next)."""
    from of3_megafold import activate

    activate()
    yield
    activate()


@pytest.fixture
def device_fallback_messages(caplog):
    """What ``registry.log_device_fallback`` says from here on (its once-per-extension
    memory cleared first): call the fixture's value for the messages so far."""
    from of3_megafold import registry

    registry.log_device_fallback.cache_clear()
    caplog.set_level("INFO", logger="of3_megafold.registry")
    return lambda: [
        r.getMessage() for r in caplog.records if "run OF3's own path" in r.getMessage()
    ]


class FakeGraph:
    """Stands in for a CUDA graph on the CPU: a replay calls the function again on
    the static input buffers (what a graph computes) and writes the output
    buffer(s). ``log`` records every replay."""

    def __init__(self, original, module, arguments, log: list[str]):
        self.original, self.module, self.arguments, self.log = (
            original, module, arguments, log)
        self.graphed = None

    def replay(self):
        self.log.append("replay")
        out = self.original(self.module, **{**self.arguments, **self.graphed.inputs})
        if isinstance(out, torch.Tensor):
            self.graphed.output.resize_(out.shape).copy_(out)
        else:
            for buffer, value in zip(self.graphed.output, out, strict=True):
                buffer.resize_(value.shape).copy_(value)


def fake_capture(log: list[str], outputs: int):
    """A ``capture(original, module, arguments, constants=())`` that records
    "capture" in ``log`` and returns a :class:`GraphedCall` on a :class:`FakeGraph`
    whose call returns one tensor (``outputs=1``) or a tuple of ``outputs`` tensors.
    Like a graph it copies tensor arguments into static buffers, except those named
    in ``constants``, which its replays read as they were at capture and which it
    holds."""
    from of3_megafold.runtime.cuda_graphs import GraphedCall

    def capture(original, module, arguments, constants=frozenset()):
        log.append("capture")
        graph = FakeGraph(original, module, arguments, log)
        inputs = {k: v.clone() for k, v in arguments.items()
                  if isinstance(v, torch.Tensor) and k not in constants}
        output = (torch.empty(0) if outputs == 1
                  else tuple(torch.empty(0) for _ in range(outputs)))
        held = tuple(arguments[k] for k in constants)
        graph.graphed = GraphedCall(graph, inputs, output, held)
        return graph.graphed

    return capture
