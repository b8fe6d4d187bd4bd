"""gradtx's examples, each a script (``python examples/<name>.py``).

This file makes ``examples`` a regular package, so ``examples.torchtitan_trainer`` (a dotted path
torchtitan's config resolves) is found in this repository first: a namespace package loses to any
installed package named ``examples`` (opacus, from ``make bench``'s extras, ships one).
"""
