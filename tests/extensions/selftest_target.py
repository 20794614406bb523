"""A stand-in for an OpenFold3 function, patched by the test-only extension."""


def compute(x: float) -> float:
    """x + 1"""
    return x + 1.0
