"""streamrec's test suite; what its tests share is in :mod:`tests.support`.

The shared helpers' asserts are rewritten as test modules' are, so a failing
check shows its values. This must run before they are first imported, which
is why it is here: pytest imports this package before any conftest.
"""

import pytest

pytest.register_assert_rewrite(
    "tests.support",
    "tests.connectors.contract",
    "tests.monitoring.reports",
    "tests.pipeline.hashing_reference",
    "tests.pipeline.plain_reference",
    "tests.serving.server",
    "tests.trainer.loop_case",
    "tests.trainer.pooling_case",
)
