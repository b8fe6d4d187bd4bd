"""Old path of :mod:`gradtx.transforms.combine`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.transforms import combine as _module
from gradtx.transforms.combine import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
