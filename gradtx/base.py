"""Old path of :mod:`gradtx.core.base`, kept so imports and pickles from before the layered layout work."""

import sys

from gradtx.core import base as _module
from gradtx.core.base import *

# The old name is the new module itself, private names included.
sys.modules[__name__] = _module
