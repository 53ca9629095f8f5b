"""The sharded collection's former import path, kept for code that imports it: the module
is ``leanstate.embedding.sharded``."""

from leanstate.embedding.sharded import *  # noqa: F403
