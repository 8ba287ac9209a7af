"""The one error type cost_models raises on purpose. It names what was wrong and what to try."""


class CostModelError(ValueError):
    """A hardware description, sharding spec, mesh or profile is invalid or does not fit the query."""
