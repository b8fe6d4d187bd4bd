"""Old path of :mod:`gradtx.transforms.conditionals`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.transforms import conditionals as _module
from gradtx.transforms.conditionals import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
