"""Errors raised on bad input.  CLIs turn them into a one-line message and exit code 2."""


class SpecError(ValueError):
    """Invalid user input (a cluster, model, profile or plan file, or a CLI value).

    The message names the offending field and the numbers involved.
    """


class PlanError(SpecError):
    """A plan that is inconsistent with itself, the model or the cluster."""


class ProfileError(SpecError):
    """A profile database that is malformed or lacks an entry that is needed."""


class InfeasibleError(SpecError):
    """No configuration satisfies the constraints (memory, batch size)."""


def is_number(value) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    import math
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_count(value) -> bool:
    """A positive int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
