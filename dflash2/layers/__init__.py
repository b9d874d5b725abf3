"""Building blocks of the model families."""
