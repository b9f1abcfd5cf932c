"""Oracles: the engines' own code, obtained from their published packages at test time and asked directly."""
