"""The version-2 checkpoint's former import path, kept for code that imports it: the
module is ``leanstate.checkpoint.sharded``."""

from leanstate.checkpoint.sharded import *  # noqa: F403
from leanstate.checkpoint.sharded import last_load_stats  # noqa: F401 - the same dict, by name
