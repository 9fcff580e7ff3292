"""echotrain.rewards."""
