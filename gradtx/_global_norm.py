"""Old path of :mod:`gradtx.distributed.global_norm`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.distributed import global_norm as _module
from gradtx.distributed.global_norm import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
