"""Old path of :mod:`gradtx.runtime.executor`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.runtime import executor as _module
from gradtx.runtime.executor import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
