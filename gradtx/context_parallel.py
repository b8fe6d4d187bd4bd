"""Old path of :mod:`gradtx.distributed.context_parallel`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.distributed import context_parallel as _module
from gradtx.distributed.context_parallel import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
