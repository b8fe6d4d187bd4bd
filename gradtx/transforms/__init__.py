"""Combining, masking, clipping, accumulation, guards and monitoring."""
