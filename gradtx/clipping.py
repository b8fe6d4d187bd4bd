"""Old path of :mod:`gradtx.transforms.clipping`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.transforms import clipping as _module
from gradtx.transforms.clipping import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
