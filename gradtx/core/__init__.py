"""The protocol, the transform kinds, tree helpers, validation and local norms (the bottom layer)."""
