"""Old path of :mod:`gradtx.schedules.hyperparams`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.schedules import hyperparams as _module
from gradtx.schedules.hyperparams import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
