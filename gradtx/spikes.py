"""Old path of :mod:`gradtx.transforms.spikes`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.transforms import spikes as _module
from gradtx.transforms.spikes import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
