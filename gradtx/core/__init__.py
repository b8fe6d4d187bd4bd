"""The protocol, tree helpers, validation and local norms (the bottom layer)."""
