"""The step plan, built once from a chain's structure and declared kinds; the donated step."""
