"""Offline training of EAGLE-2 draft heads: data, batched target generation, features, trainer."""
