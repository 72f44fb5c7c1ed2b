"""The operator tests' fixtures (kmock API server, the real operator) for the dashboards tests."""

from tests.operator.conftest import cluster, operator  # noqa: F401
