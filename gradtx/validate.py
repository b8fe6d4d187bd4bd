"""Old path of :mod:`gradtx.core.validate`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.core import validate as _module
from gradtx.core.validate import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
