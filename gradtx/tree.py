"""Old path of :mod:`gradtx.core.tree`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.core import tree as _module
from gradtx.core.tree import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
