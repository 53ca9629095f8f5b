"""Registered with pytest (entry point ``pytest11``): pytest rewrites the asserts of the
conformance kit, so a failing check shows the values it compared, not a bare
``AssertionError``. Importing ``leanstate.testing`` here would come too early for that."""

import pytest

pytest.register_assert_rewrite("leanstate.testing")
