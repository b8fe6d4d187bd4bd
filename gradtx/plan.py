"""Old path of :mod:`gradtx.distributed.plan`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.distributed import plan as _module
from gradtx.distributed.plan import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
